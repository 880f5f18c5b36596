"""The smaller seams of issue 23 item 11, each as a new user met it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from factory import vit_store

from actstore.capture import ranks
from actstore.cli import main
from actstore.errors import CaptureError


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_write_help_lists_every_data_kind_and_a_readable_separator():
    out = " ".join(cli("write", "--help").output.split())
    for kind in (".txt", "glob", ".parquet", ".arrow"):
        assert kind in out, kind
    assert "('\\n')" not in out and "[default: (newline)]" in out


@pytest.mark.torch  # `actstore write` needs torch
def test_a_folder_of_txt_files_is_pointed_to_a_glob(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello", encoding="utf-8")
    res = cli("write", tmp_path / "s", "--model", tmp_path, "--data", tmp_path / "docs", "--layers", "0", "--quiet")
    assert res.exit_code == 1
    assert (
        f"{tmp_path / 'docs'} holds .txt files, not images: pass a glob such as '{tmp_path / 'docs'}/*.txt'"
        in res.output
    )


def test_info_names_the_mean_l2_norm(tmp_path):
    vit_store(tmp_path / "s", stats=True)
    out = cli("info", tmp_path / "s").output
    assert "mean |x|" not in out and "mean L2" in out


def test_an_array_task_id_without_a_count_is_refused():
    with pytest.raises(
        CaptureError, match=r"SLURM_ARRAY_TASK_ID=3 is set but SLURM_ARRAY_TASK_COUNT is not.*--rank/--world-size"
    ):
        ranks.from_env({"SLURM_ARRAY_TASK_ID": "3"})


def test_verify_saev_on_an_actstore_store_points_to_actstore_verify(tmp_path):
    vit_store(tmp_path / "s")
    res = cli("verify-saev", tmp_path / "s")
    assert (
        res.exit_code == 1
        and "is an actstore store, not a saev shard directory: check it with `actstore verify" in res.output
    )


def test_cli_messages_name_flags_not_python_arguments(tmp_path):
    from actstore.cli.wording import cli_words

    assert (
        cli_words("exists; pass overwrite=True (--overwrite) to rebuild it", None)
        == "exists; pass --overwrite to rebuild it"
    )
    assert cli_words("pass dataset (--dataset), the absolute path", None) == "pass --dataset, the absolute path"
    assert (
        cli_words("or pass allow_partial=True (`actstore finalize --allow-partial`) to", None).count("allow_partial")
        == 1
    )
    out = cli_words(
        "shard 0 of x already exists; pass resume=True to continue it or overwrite=True to replace it",
        main.get_command(None, "write"),
    )
    assert (
        out == "shard 0 of x already exists; pass --resume to continue it or overwrite=True to replace it"
    )  # write has no --overwrite
    store = vit_store(tmp_path / "s")
    (tmp_path / "d").mkdir()
    first = cli("export-saev", store.path, tmp_path / "d", "--quiet").output.strip().splitlines()[-1]
    import os

    os.chmod(first, 0o755)
    os.remove(os.path.join(first, "shards.json"))  # broken: a rerun refuses, naming the flag
    res = cli("export-saev", store.path, tmp_path / "d")
    assert res.exit_code == 1 and "pass --overwrite to rebuild it" in res.output and "overwrite=True" not in res.output
