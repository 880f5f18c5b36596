"""`actstore write STORE`: capture a model's activations over a dataset into a new store.

Every option is a field of one CaptureOptions (actstore.capture.options), built here and
handed to actstore.capture.write; `write --help` lists them in sections. Old spellings
(--engine, --drop) still work for one release, with a warning (actstore.cli.grammar).
"""

from __future__ import annotations

import click

from actstore.capture.options import DEFAULT_QUEUE, DEFAULT_WRITER_NICE, RUNNERS, SPECIAL
from actstore.cli import grammar as G
from actstore.cli.params import DEVICE, DEVICE_SPELLING, NEW_STORE, FiniteFloat
from actstore.cli.sections import SectionedCommand, section_option
from actstore.layout import spec
from actstore.read.layers import parse_layer_list

WHAT, MODEL, DATA, TEXTS, WINDOWS, LAYOUT, PIPE, WRITERS = (
    "What to record",
    "The model",
    "The data",
    "Texts, prompts and responses",
    "Corpora in context windows",
    "Store layout and commits",
    "The capture pipeline",
    "Writers and resuming",
)


def register(main: click.Group) -> None:
    main.add_command(write_cmd)


def parse_layers(value: str) -> tuple[int | str, ...]:
    """--layers: numbers, ranges (0-11) and names (actstore.read.layers), in order."""
    out: list[int | str] = []
    for x in parse_layer_list(value):
        if isinstance(x, str) and "-" in x and all(p.isdigit() for p in x.split("-", 1)):
            a, b = (int(p) for p in x.split("-", 1))
            out.extend(range(a, b + 1))
        else:
            out.append(x)
    return tuple(out)


@click.command("write", cls=SectionedCommand)
@click.argument("store", type=NEW_STORE)
@section_option(
    WHAT,
    "--model",
    required=True,
    multiple=True,
    help="A local model folder, a hub id, or embedded:dinov2-s14 | embedded:smollm2-135m | embedded:minilm-l6. Given twice or more (text models of one tokenizer: a base model and its fine-tune), every model runs over the same examples into one aligned family of stores (docs/capture.md).",
)
@section_option(
    WHAT,
    "--data",
    required=True,
    help='A folder of images, a .jsonl of texts ({"text"}) or pairs ({"prompt", "response"}), a .txt file (a document a line), a glob of files (\'corpus/*.txt\': a document a file; quote it), a .parquet or .arrow file, a datasets save_to_disk folder, or embedded:images | embedded:pydoc-topics.',
)
@section_option(
    WHAT,
    "--layers",
    required=True,
    help="Blocks to record, e.g. 6,11, 0-11 or -1 (layer N = output of block N = hidden_states[N+1]; -1 the last block), TransformerLens names (blocks.8.hook_resid_post, blocks.8.hook_resid_pre, blocks.8.hook_mlp_out, blocks.8.hook_attn_out), or module paths such as model.layers.6.mlp.",
)
@section_option(
    WHAT,
    "--dtype",
    type=click.Choice(list(spec.ACT_DTYPES)),
    default=spec.DEFAULT_DTYPE,
    show_default=True,
    help="Stored dtype.",
)
@section_option(
    WHAT,
    "--special",
    type=click.Choice(list(SPECIAL)),
    default="mask",
    show_default=True,
    help="Special tokens (BOS, EOS, chat-template text; a ViT's CLS): store them labelled, left out by the loaders' default mask and the statistics (mask), store them as content, unlabelled (keep), or do not store them (drop; the model still sees them).",
)
@section_option(
    WHAT, "--drop", type=click.Choice(["bos", "cls"]), multiple=True, hidden=True, help="Deprecated: --special drop."
)
@section_option(WHAT, "--no-stats", is_flag=True, help="Do not keep running statistics.")
@section_option(
    WHAT,
    "--on-overflow",
    type=click.Choice(["raise", "clip"]),
    default="raise",
    show_default=True,
    help="Values beyond the stored dtype's range: stop with an error, or clip and count them.",
)
@section_option(
    MODEL,
    "--device",
    type=DEVICE_SPELLING,
    default="cpu",
    show_default=True,
    help="cpu, cuda or cuda:N (N among the CUDA devices torch sees here, or on each Ray worker).",
)
@section_option(
    MODEL,
    "--model-dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="The dtype the model computes in.",
)
@section_option(MODEL, "--batch-size", type=int, default=8, show_default=True)
@section_option(DATA, "--max-examples", type=int, default=None, help="Capture only the first N examples of the data.")
@section_option(
    DATA,
    "--text-field",
    default=None,
    help="The JSON key or column holding each document's text (.jsonl, .parquet, .arrow, a datasets folder; default text).",
)
@section_option(
    DATA, "--encoding", default="utf-8", show_default=True, help="Encoding of .txt documents (e.g. latin-1, cp1252)."
)
@section_option(
    DATA,
    "--errors",
    type=click.Choice(["strict", "replace", "skip"]),
    default="strict",
    show_default=True,
    help="A .txt document that does not decode: fail before the model loads (strict), replace its undecodable bytes with U+FFFD (replace), or leave it out (skip); replace and skip print how many documents they touched.",
)
@section_option(
    TEXTS,
    "--p-max",
    type=int,
    default=None,
    help="Token budget of a text or prompt (default: the 0.99 quantile of the measured lengths); longer ones are truncated and counted.",
)
@section_option(
    TEXTS,
    "--r-max",
    type=int,
    default=None,
    help="Token budget of a response (default: the 0.99 quantile of the measured lengths, or N with --generate N).",
)
@section_option(
    TEXTS,
    "--p-quantile",
    type=float,
    default=None,
    help="Choose --p-max as this quantile of the prompt lengths, e.g. 0.99.",
)
@section_option(
    TEXTS, "--r-quantile", type=float, default=None, help="Choose --r-max as this quantile of the response lengths."
)
@section_option(
    TEXTS,
    "--separator",
    default="\n",
    show_default="newline",
    help="Pairs without --chat-template: the text between prompt and response (its tokens end the prompt, labelled template; '' for none).",
)
@section_option(
    TEXTS,
    "--bos",
    type=click.Choice(list(spec.BOS_MODES)),
    default="auto",
    show_default=True,
    help="Token 0 of each text or prompt (not --pack/--chunk: see --no-window-bos): auto prepends the tokenizer's BOS, labelled special, unless the tokenizer or chat template adds it (a tokenizer without BOS: the first position is labelled 'first'); both are left out by the default mask, so the model's attention sink does not count as content. always: as auto, refusing a tokenizer without BOS; never: the text as tokenized.",
)
@section_option(TEXTS, "--chat-template", is_flag=True, help="Wrap prompts in the tokenizer's chat template.")
@section_option(
    TEXTS,
    "--system",
    default=None,
    help="With --chat-template: the system prompt (default: whatever the template adds by itself, named on stderr when it adds one).",
)
@section_option(
    TEXTS,
    "--no-system",
    is_flag=True,
    help="With --chat-template: an empty system turn, so that the template adds no default system prompt.",
)
@section_option(
    TEXTS,
    "--generate",
    type=int,
    default=0,
    show_default=True,
    help='Generate N response tokens per prompt (greedy unless --temperature) instead of reading responses; data that gives a "response" is refused (leave out --generate to capture it).',
)
@section_option(
    TEXTS,
    "--temperature",
    type=FiniteFloat(0.0),
    default=0.0,
    show_default=True,
    help="With --generate: sample at this temperature (0: greedy).",
)
@section_option(
    TEXTS,
    "--top-p",
    type=FiniteFloat(0.0, 1.0, open_low=True),
    default=1.0,
    show_default=True,
    help="With --generate and --temperature: nucleus sampling's probability mass.",
)
@section_option(
    TEXTS,
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="With --generate and --temperature: batch k samples from SEED + its first example's index (reproducible, whatever the writers).",
)
@section_option(
    WINDOWS,
    "--pack",
    is_flag=True,
    help="Concatenate the documents (tokenizer's BOS/EOS between them) into windows of exactly --context tokens: every token stored once.",
)
@section_option(
    WINDOWS,
    "--chunk",
    is_flag=True,
    help="Cut each document into consecutive windows of at most --context tokens (no truncation, no window spans documents).",
)
@section_option(WINDOWS, "--context", type=int, default=None, help="Window length in tokens for --pack / --chunk.")
@section_option(
    WINDOWS,
    "--no-window-bos",
    is_flag=True,
    help="--pack / --chunk: do not start each window with the tokenizer's BOS (by default every window starts with it, or with its EOS when it has no BOS, labelled special, followed by --context - 1 corpus tokens).",
)
@section_option(
    LAYOUT,
    "--zarr-format",
    type=click.Choice(["2", "3"]),
    default=str(spec.DEFAULT_ZARR_FORMAT),
    show_default=True,
    help="Zarr format of the store's arrays: 3, Zarr shard files of many examples (scales to billions of tokens and object storage); 2, the chunk-file layout (one file per example and layer).",
)
@section_option(
    LAYOUT,
    "--shard-examples",
    type=int,
    default=None,
    help="With --zarr-format 3: examples per Zarr shard file (one file holds every layer of N examples). Default: those that fill about 256 MiB.",
)
@section_option(
    LAYOUT,
    "--commit-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=spec.DEFAULT_COMMIT_BYTES / 2**20,
    show_default=True,
    help="Commit (make durable) every this many MB of activations.",
)
@section_option(
    LAYOUT,
    "--fsync",
    is_flag=True,
    help="Durable against power loss, not only crashes: every file synced before its commit.",
)
@section_option(
    PIPE,
    "--queue-size",
    type=int,
    default=DEFAULT_QUEUE,
    show_default=True,
    help="Batches the writer may lag behind the model (host memory: queue size + 2 batches).",
)
@section_option(
    PIPE,
    "--writer-threads",
    type=int,
    default=None,
    help="Threads that write shard files and compute statistics on a CPU (default: half the cores, 2 to 8).",
)
@section_option(
    PIPE,
    "--writer-nice",
    type=click.IntRange(0, 19),
    default=DEFAULT_WRITER_NICE,
    show_default=True,
    help="Lower the writer threads' priority by N (Linux nice, per thread) so that they run in the model's gaps; 0: normal priority.",
)
@section_option(
    WRITERS,
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Writers actstore starts (one shard each): processes on this machine, or actors with --runner ray.",
)
@section_option(
    WRITERS,
    "--runner",
    type=click.Choice(list(RUNNERS)),
    default=None,
    callback=G.resolve,
    help="Where --workers run: local processes (default), or actors on a Ray cluster (RAY_ADDRESS / --ray-address, else a local one; pip install 'actstore[ray]').",
)
@G.alias("--engine", of="runner", use="--runner", type=click.Choice(list(RUNNERS)))
@section_option(
    WRITERS,
    "--cpus-per-worker",
    type=float,
    default=1.0,
    show_default=True,
    help="With --runner ray: CPUs each writer actor reserves.",
)
@section_option(
    WRITERS,
    "--gpus-per-worker",
    type=float,
    default=0.0,
    show_default=True,
    help="With --runner ray: GPUs each writer actor reserves (use --device cuda).",
)
@section_option(
    WRITERS,
    "--ray-address",
    default=None,
    help="With --runner ray: the cluster to join (default RAY_ADDRESS, else a local cluster).",
)
@section_option(
    WRITERS,
    "--rank",
    type=int,
    default=None,
    help="This writer's rank; writes shard RANK. Default: from SLURM_ARRAY_TASK_ID, SLURM_PROCID or RANK (torchrun), else 0.",
)
@section_option(
    WRITERS,
    "--world-size",
    type=int,
    default=None,
    help="Number of ranks (default: from Slurm or torchrun, else 1); run `actstore finalize STORE` once all are done.",
)
@section_option(WRITERS, "--resume", is_flag=True, help="Continue every writer after its last committed example.")
@section_option(
    WRITERS, "--no-finalize", is_flag=True, help="Leave the store unfinalized (run `actstore finalize` later)."
)
@G.quiet_json(quiet="No progress bar.", json="Print one JSON summary on stdout instead of the summary line.")
def write_cmd(store: str, **kw) -> None:
    """Capture a model's activations over a dataset into STORE.

    Records the output of each chosen transformer block (the residual stream) for every
    example, in data order, as (example, layer, token, d_model) activations; keeps
    running statistics; finalizes the store. The main job on the embedded ViT:

        actstore write out/vit.store --model embedded:dinov2-s14 --data embedded:images --layers 6,11
    """
    import os

    G.require_extras("write", ("torch", "transformers"))
    # torch's OpenMP threads otherwise spin at every barrier while the writer thread works,
    # burning the cores the model needs (measured: 11 % more CPU on 2 cores). Takes effect
    # only if torch is not imported yet; an OMP_WAIT_POLICY already set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from actstore.capture import family, run

    models = kw.pop("model")
    o = options(store, {**kw, "model": models[0]})
    several = len(models) > 1 or family.may_differ(o.layers)  # several models or widths: a family
    s = family.write_models(o, models, run.write) if several else run.write(o)
    if s.get("sink_warning"):
        G.warn(s["sink_warning"])
    if kw["as_json"]:
        import json

        click.echo(json.dumps(s))
        return
    rate = s["written"] / s["capture_seconds"] if s["capture_seconds"] else 0.0
    click.echo(
        f"wrote {s['written']} examples ({s['tokens']:,} tokens per layer, {s['bytes'] / 2**20:.1f} MiB) to {store} "
        f"in {s['seconds']:.1f} s ({s['capture_seconds']:.1f} s capturing, {rate:.1f} examples/s); "
        f"{s['examples']} examples in shard(s) {s['shards']}"
        + ("; finalized" if s["finalized"] else f"; run `actstore finalize {store}` once every writer is done")
    )
    if s.get("mask_line"):
        click.echo(s["mask_line"])
    if s["truncated_tokens"]:
        pct = 100 * s["truncated_tokens"] / s["source_tokens"]
        click.echo(
            f"truncated: {s['truncated_tokens']:,} of the data's {s['source_tokens']:,} tokens ({pct:.1f}%) exceeded the "
            "token budgets (--p-max/--r-max) and were not stored; --pack or --chunk store every token"
        )


def options(store: str, kw: dict):
    """The CaptureOptions of a `write` command line (old spellings mapped, with a warning)."""
    from actstore.capture.options import CaptureOptions

    if kw["drop"]:  # (not an alias: --drop bos leaves out the BOS tokens alone, for this release)
        G.deprecated("--drop", "--special drop (which leaves out every special and template token)")
    if kw["system"] is not None and kw["no_system"]:
        raise click.UsageError("give --system TEXT or --no-system, not both")
    if (kw["runner"] or "local") == "local":
        DEVICE.convert(kw["device"], None, None)  # a CUDA device torch sees here (Ray workers check theirs)
    taken = {"store", "as_json", "quiet", "layers", "runner", "drop", "system", "no_system", "no_stats"}
    taken |= {"no_window_bos", "no_finalize", "commit_mb", "zarr_format", "shard_examples"}
    return CaptureOptions(
        store=store,
        layers=parse_layers(kw["layers"]),
        runner=kw["runner"] or "local",
        drop=tuple(kw["drop"]),
        system="" if kw["no_system"] else kw["system"],
        stats=not kw["no_stats"],
        window_bos=not kw["no_window_bos"],
        finalize=not kw["no_finalize"],
        progress=not kw["quiet"],
        commit_bytes=max(1, int(kw["commit_mb"] * 2**20)),
        zarr_format=int(kw["zarr_format"]),
        shard_examples=kw["shard_examples"] if kw["shard_examples"] is not None else spec.SHARD_EXAMPLES_AUTO,
        **{k: v for k, v in kw.items() if k not in taken},
    )
