"""`actstore write`: capture a model's activations into a store."""

from __future__ import annotations

import importlib.util
import sys

import click

from actstore.cli.params import NEW_STORE

from actstore.layout import spec
from actstore.capture.record import DEFAULT_WRITER_NICE


def register(main: click.Group) -> None:
    main.add_command(write_cmd)


def _layers(value: str) -> tuple[int | str, ...]:
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    out: list[int | str] = []
    for x in items:
        if x.lstrip("-").isdigit():  # a block number; negative counts from the end (-1: the last block)
            out.append(int(x))
        elif "-" in x and all(p.isdigit() for p in x.split("-", 1)):
            a, b = (int(p) for p in x.split("-", 1))
            out.extend(range(a, b + 1))
        else:
            out.append(x)
    return tuple(out)


def _require(command: str, modules: tuple[str, ...]) -> None:
    """Exit 1 with the install command when a package capture needs is missing (the core
    install, `pip install actstore`, has no torch)."""
    missing = [{"PIL": "pillow"}.get(m, m) for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        click.echo(
            f"actstore: error: `actstore {command}` needs {' and '.join(missing)}, not installed here: "
            "pip install 'actstore[capture]'",
            err=True,
        )
        sys.exit(1)


@click.command("write")
@click.argument("store", type=NEW_STORE)
@click.option(
    "--model",
    required=True,
    help="A local model folder, a hub id, or embedded:dinov2-s14 | embedded:smollm2-135m | embedded:minilm-l6.",
)
@click.option(
    "--data",
    required=True,
    help='A folder of images, a .jsonl of texts ({"text"}) or pairs ({"prompt", "response"}), a .txt file '
    "(a document a line), a glob of files ('corpus/*.txt': a document a file; quote it), a .parquet or .arrow file, "
    "a datasets save_to_disk folder, or embedded:images | embedded:pydoc-topics.",
)
@click.option(
    "--layers",
    required=True,
    help="Blocks to record, e.g. 6,11, 0-11 or -1 (layer N = output of block N = hidden_states[N+1]; -1 the last block), TransformerLens names (blocks.8.hook_resid_post, blocks.8.hook_resid_pre, blocks.8.hook_mlp_out, blocks.8.hook_attn_out), or module paths such as model.layers.6.mlp.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(spec.ACT_DTYPES)),
    default=spec.DEFAULT_DTYPE,
    show_default=True,
    help="Stored dtype.",
)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option(
    "--model-dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="The dtype the model computes in.",
)
@click.option("--max-examples", type=int, default=None, help="Capture only the first N examples of the data.")
@click.option(
    "--p-max",
    type=int,
    default=None,
    help="Token budget of a text or prompt (default: the 0.99 quantile of the measured lengths); longer ones are truncated and counted.",
)
@click.option(
    "--r-max",
    type=int,
    default=None,
    help="Token budget of a response (default: the 0.99 quantile of the measured lengths, or N with --generate N).",
)
@click.option(
    "--p-quantile", type=float, default=None, help="Choose --p-max as this quantile of the prompt lengths, e.g. 0.99."
)
@click.option("--r-quantile", type=float, default=None, help="Choose --r-max as this quantile of the response lengths.")
@click.option(
    "--generate",
    type=int,
    default=0,
    show_default=True,
    help="Generate N response tokens per prompt (greedy) instead of reading responses.",
)
@click.option(
    "--special",
    type=click.Choice(["mask", "drop"]),
    default="mask",
    show_default=True,
    help="Special and chat-template tokens: keep them with a per-token label (mask) or do not store them (drop).",
)
@click.option(
    "--drop",
    type=click.Choice(["bos", "cls"]),
    multiple=True,
    help="Tokens the model sees but the store leaves out: bos (the tokenizer's BOS tokens; texts) or cls (token 0 of a ViT). Repeatable.",
)
@click.option(
    "--separator",
    default="\n",
    show_default="newline",
    help="Pairs without --chat-template: the text between prompt and response (its tokens end the prompt, labelled template; '' for none).",
)
@click.option("--chat-template", is_flag=True, help="Wrap prompts in the tokenizer's chat template.")
@click.option(
    "--pack",
    is_flag=True,
    help="Concatenate the documents (tokenizer's BOS/EOS between them) into windows of exactly --context tokens: every token stored once.",
)
@click.option(
    "--chunk",
    is_flag=True,
    help="Cut each document into consecutive windows of at most --context tokens (no truncation, no window spans documents).",
)
@click.option("--context", type=int, default=None, help="Window length in tokens for --pack / --chunk.")
@click.option(
    "--encoding", default="utf-8", show_default=True, help="Encoding of .txt documents (e.g. latin-1, cp1252)."
)
@click.option(
    "--errors",
    type=click.Choice(["strict", "replace", "skip"]),
    default="strict",
    show_default=True,
    help="A .txt document that does not decode: fail before the model loads (strict), replace its undecodable bytes "
    "with U+FFFD (replace), or leave it out (skip); replace and skip print how many documents they touched.",
)
@click.option(
    "--no-window-bos",
    is_flag=True,
    help="--pack / --chunk: do not start each window with the tokenizer's BOS (by default every window "
    "starts with it, or with its EOS when it has no BOS, labelled special, followed by --context - 1 corpus tokens).",
)
@click.option(
    "--text-field",
    default=None,
    help="The JSON key or column holding each document's text (.jsonl, .parquet, .arrow, a datasets folder; default text).",
)
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Writers actstore starts (one shard each): processes on this machine, or actors with --engine ray.",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where --workers run: local processes, or actors on a Ray cluster (RAY_ADDRESS / --ray-address, else a local one; pip install 'actstore[ray]').",
)
@click.option(
    "--cpus-per-worker",
    type=float,
    default=1.0,
    show_default=True,
    help="With --engine ray: CPUs each writer actor reserves.",
)
@click.option(
    "--gpus-per-worker",
    type=float,
    default=0.0,
    show_default=True,
    help="With --engine ray: GPUs each writer actor reserves (use --device cuda).",
)
@click.option(
    "--ray-address",
    default=None,
    help="With --engine ray: the cluster to join (default RAY_ADDRESS, else a local cluster).",
)
@click.option(
    "--rank",
    type=int,
    default=None,
    help="This writer's rank; writes shard RANK. Default: from SLURM_ARRAY_TASK_ID, SLURM_PROCID or RANK (torchrun), else 0.",
)
@click.option(
    "--world-size",
    type=int,
    default=None,
    help="Number of ranks (default: from Slurm or torchrun, else 1); run `actstore finalize STORE` once all are done.",
)
@click.option("--resume", is_flag=True, help="Continue every writer after its last committed example.")
@click.option("--no-finalize", is_flag=True, help="Leave the store unfinalized (run `actstore finalize` later).")
@click.option(
    "--commit-mb",
    type=float,
    default=spec.DEFAULT_COMMIT_BYTES / 2**20,
    show_default=True,
    help="Commit (make durable) every this many MB of activations.",
)
@click.option(
    "--on-overflow",
    type=click.Choice(["raise", "clip"]),
    default="raise",
    show_default=True,
    help="Values beyond the stored dtype's range: stop with an error, or clip and count them.",
)
@click.option(
    "--queue-size", type=int, default=4, show_default=True, help="Batches the writer thread may lag behind the model."
)
@click.option("--no-stats", is_flag=True, help="Do not keep running statistics.")
@click.option(
    "--writer-nice",
    type=click.IntRange(0, 19),
    default=DEFAULT_WRITER_NICE,
    show_default=True,
    help="Lower the writer thread's priority by N (Linux nice, per thread) so that it runs in the model's gaps; 0: normal priority.",
)
@click.option(
    "--zarr-format",
    type=click.Choice(["2", "3"]),
    default=str(spec.DEFAULT_ZARR_FORMAT),
    show_default=True,
    help="Zarr format of the store's arrays: 3, Zarr shard files of many examples (scales to billions of tokens and object storage); 2, the chunk-file layout (one file per example and layer).",
)
@click.option(
    "--shard-examples",
    type=int,
    default=None,
    help="With --zarr-format 3: examples per Zarr shard file (one file holds every layer of N examples). Default: those that fill about 256 MiB.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout instead of the summary line.")
def write_cmd(store: str, **kw) -> None:
    """Capture a model's activations over a dataset into STORE.

    Records the output of each chosen transformer block (the residual stream) for every
    example, in data order, as (example, layer, token, d_model) activations; keeps
    running statistics; finalizes the store. The main job on the embedded ViT:

        actstore write out/vit.store --model embedded:dinov2-s14 --data embedded:images --layers 6,11
    """
    import os

    _require("write", ("torch", "transformers"))
    # torch's OpenMP threads otherwise spin at every barrier while the writer thread works,
    # burning the cores the model needs (measured: 11 % more CPU on 2 cores). Takes effect
    # only if torch is not imported yet; an OMP_WAIT_POLICY already set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from actstore.capture.run import WriteOptions, write

    opts = WriteOptions(
        store=store,
        model=kw["model"],
        data=kw["data"],
        layers=_layers(kw["layers"]),
        dtype=kw["dtype"],
        batch_size=kw["batch_size"],
        device=kw["device"],
        model_dtype=kw["model_dtype"],
        max_examples=kw["max_examples"],
        p_max=kw["p_max"],
        r_max=kw["r_max"],
        p_quantile=kw["p_quantile"],
        r_quantile=kw["r_quantile"],
        generate=kw["generate"],
        special=kw["special"],
        chat_template=kw["chat_template"],
        workers=kw["workers"],
        rank=kw["rank"],
        world_size=kw["world_size"],
        engine=kw["engine"],
        cpus_per_worker=kw["cpus_per_worker"],
        gpus_per_worker=kw["gpus_per_worker"],
        ray_address=kw["ray_address"],
        resume=kw["resume"],
        pack=kw["pack"],
        chunk=kw["chunk"],
        context=kw["context"],
        window_bos=not kw["no_window_bos"],
        encoding=kw["encoding"],
        errors=kw["errors"],
        text_field=kw["text_field"],
        drop=tuple(kw["drop"]),
        separator=kw["separator"],
        finalize=not kw["no_finalize"],
        commit_mb=kw["commit_mb"],
        on_overflow=kw["on_overflow"],
        queue_size=kw["queue_size"],
        stats=not kw["no_stats"],
        progress=not kw["quiet"],
        zarr_format=int(kw["zarr_format"]),
        shard_examples=kw["shard_examples"] if kw["shard_examples"] is not None else spec.SHARD_EXAMPLES_AUTO,
        writer_nice=kw["writer_nice"],
    )
    s = write(opts)
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
    if s["truncated_tokens"]:
        pct = 100 * s["truncated_tokens"] / s["source_tokens"]
        click.echo(
            f"truncated: {s['truncated_tokens']:,} of the data's {s['source_tokens']:,} tokens ({pct:.1f}%) exceeded the "
            "token budgets (--p-max/--r-max) and were not stored; --pack or --chunk store every token"
        )
