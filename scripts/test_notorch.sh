#!/usr/bin/env bash
# The core's tests on the core install (`pip install actstore`: no torch, no transformers),
# beside the main suite's full dev install: writer, reader, finalize, verify, statistics,
# exports and the CLI must work without torch. The list is every test file whose tests do
# not need torch (a test of the main suite checks that none is forgotten). Left out: files
# that import torch at the top (loaders, capture, ...), test_loaders_exit.py (its script streams batches with torch), test_benchmarks_run.py (the benchmarks capture and stream with torch), test_capture_resume.py, test_distributed.py and test_preflight.py (use a
# torch model), test_capture_support.py (helpers, no tests), and test_copy.py,
# test_storage.py, test_storage_cache.py, test_remote.py, test_remote_access.py, test_retry.py and test_scale_requests.py, whose S3
# cases need moto's server (the main suite has it); test_saelens_check.py and test_export_oserrors.py
# (export-saelens streams through torch's TokenStream); test_mutations.py (2,200 mutations, about 2 minutes: the main suite
# runs them; the paths they exercise have no torch branch) and test_docs_blocks.py (capture
# commands of docs/ need torch), test_crosscoder_example.py (its script trains with torch),
# test_saelens_card.py (export-saelens streams through the torch TokenStream),
# test_features_site.py (decodes with a transformers tokenizer, reads the parquet files with
# pandas, drives chromium), test_features_views.py and test_features_exports.py (build on
# test_features_site.py's stores, tokenizer and browser; delphi's loader imports torch) and
# test_features_embedded.py (captures with a real model),
# test_data_checks.py and test_layer_parser.py (capture with tiny torch models),
# test_cli_workflow.py (its word store's tokenizer is a transformers one; the feature pass and site),
# test_cli_extras.py (its word store's tokenizer is a transformers one; export-saelens streams through torch),
# test_remote_messages.py and test_lost_objects.py (moto's server), test_features_signs.py (the
# torch update against the numba one), test_features_faults.py (moto's server; the CLI's features
# encodes with torch), test_import_integrity.py (Activault megabatches and SAELens caches are
# torch files) and test_hostile_inputs.py (its torch-version and --bias cases load torch).
# The feature pass's oracle tests run here, but
# for their S3 case (moto's server) and their compiled-kernel cases (numba comes with the views
# extra; test_features_kernel.py compares it with the numpy reference). Deselected by name: the embedded-images export
# (its images need Pillow) and the txt-folder message of `actstore write` (needs torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3.11
if ! command -v "$PY" >/dev/null; then
  echo "scripts/test_notorch.sh: no python3.11 on PATH" >&2
  exit 1
fi
stamp=.venv-notorch/.actstore-setup
want=$(cat pyproject.toml scripts/test_notorch.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x .venv-notorch/bin/python ] || "$PY" -m venv .venv-notorch
  .venv-notorch/bin/python -m pip --disable-pip-version-check -q install -e . pytest pytest-xdist hypothesis ruff \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$want" > "$stamp"
fi
if .venv-notorch/bin/python -c "import torch" 2>/dev/null; then
  echo "scripts/test_notorch.sh: torch is installed in .venv-notorch; remove the folder and rerun" >&2
  exit 1
fi
# Deselected: the two tests of these files that use torch (a DataLoader; torch's half cast).
ACTSTORE_NO_SKIP=1 .venv-notorch/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile \
  tests/test_notorch.py tests/test_dtypes.py tests/test_architecture.py tests/test_cli_core.py tests/test_examples.py \
  tests/test_checksum.py tests/test_cli_output.py tests/test_faults.py tests/test_format_doc.py tests/test_fuzz.py tests/test_index.py tests/test_leases.py tests/test_legacy.py \
  tests/test_open.py tests/test_processes.py tests/test_roundtrip.py tests/test_saev_common.py tests/test_saev_export.py \
  tests/test_saev_golden.py tests/test_saev_kill.py tests/test_saev_reader.py tests/test_saev_verify.py \
  tests/test_select.py tests/test_shard_claim.py tests/test_sharded_writes.py tests/test_store_golden.py tests/test_verify.py \
  tests/test_verify_hostile.py tests/test_verify_entries.py tests/test_write_pipeline.py tests/test_xarray.py tests/test_zarr_compat.py \
  tests/test_hostile_files.py tests/test_hostile_meta.py tests/test_hostile_legacy.py tests/test_hostile_saev.py tests/test_reliability_doc.py \
  tests/test_per_sample_chunks.py tests/test_import_dictionary_learning.py tests/test_features_topk.py tests/test_saev_checksums.py \
  tests/test_writer_options.py tests/test_per_sample_checksums.py \
  tests/test_arguments.py tests/test_cli_grammar.py tests/test_docs_claims.py tests/test_saev_budget.py tests/test_seams_saev.py tests/test_small_seams.py tests/test_read_mapped.py \
  --deselect tests/test_faults.py::test_dataloader_readers_never_see_a_shard_before_finalize \
  --deselect tests/test_saev_export.py::test_torch_and_numpy_half_conversions_give_the_same_bytes \
  --deselect tests/test_features_topk.py::test_s3_store_matches_the_oracle \
  --deselect tests/test_seams_saev.py::test_export_of_an_embedded_images_store_needs_no_options_and_verifies \
  --deselect tests/test_small_seams.py::test_a_folder_of_txt_files_is_pointed_to_a_glob \
  -k "not numba"
