"""Bad devices, thread counts and sampling options: one usage error each (exit 2, one
line naming the option and the allowed values), raised before any model loads or any
store is read (a model loader that fails loudly proves it), in the CLI and the library."""

from __future__ import annotations

import math

import pytest
import torch
from factory import cli, plain_vit_store

from actstore.capture import run
from actstore.capture.options import CaptureOptions, check_job
from actstore.devices import parse_device
from actstore.errors import CaptureError, DeviceError
from actstore.write.options import WriterOptions


@pytest.fixture
def no_model(monkeypatch):
    """load_model that fails loudly: an option refused after it was called fails the test."""

    def loud(*a, **k):
        raise AssertionError("the model was loaded before the bad option was refused")

    monkeypatch.setattr(run, "load_model", loud)


def write(tmp_path, *options):
    args = ["write", tmp_path / "s", "--model", tmp_path / "no-such-model", "--data", "embedded:pydoc-topics"]
    return cli(*args, "--layers", "0", "--max-examples", "2", *options, ok=False)


def usage_error(res, message: str) -> None:
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output + repr(res.exception)
    assert errors == [f"Error: {message}"], res.output


ALLOWED = "must be one of 'cpu', 'cuda', 'cuda:N'"


@pytest.mark.parametrize("device", ["tpu", "", "cuda:-1", "mps", "cuda:x", "CPU", " cpu"])
def test_write_refuses_a_device_no_command_uses(tmp_path, no_model, device):
    usage_error(write(tmp_path, "--device", device), f"Invalid value for '--device': {ALLOWED}. Got {device!r}.")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", ["features", "export-delphi"])
@pytest.mark.parametrize("device", ["tpu", "", "cuda:-1", "mps"])
def test_features_and_export_delphi_refuse_a_device_no_command_uses(tmp_path, command, device):
    store = plain_vit_store(tmp_path / "st")
    res = cli(command, store, "--layer", "0", "--neurons", "--device", device, "-o", tmp_path / "out", ok=False)
    usage_error(res, f"Invalid value for '--device': {ALLOWED} or 'auto'. Got {device!r}.")
    assert not (tmp_path / "out").exists()


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_a_cuda_device_beyond_the_visible_ones_is_refused(tmp_path, monkeypatch, no_model):
    fake_gpus(monkeypatch, 2)
    assert [parse_device(d) for d in ("cpu", "cuda", "cuda:0", "cuda:1")] == ["cpu", "cuda", "cuda:0", "cuda:1"]
    assert parse_device(torch.device("cuda", 1)) == "cuda:1"
    message = "cuda:2: torch sees 2 CUDA devices (cuda:0..cuda:1; CUDA_VISIBLE_DEVICES applies); pick one of them"
    usage_error(write(tmp_path, "--device", "cuda:2"), f"Invalid value for '--device': {message}")
    fake_gpus(monkeypatch, 0)
    usage_error(
        write(tmp_path, "--device", "cuda"),
        f"Invalid value for '--device': cuda: torch {torch.__version__} sees no CUDA device here; use cpu",
    )


def test_a_ray_runner_checks_only_the_spelling_of_its_workers_device(monkeypatch):
    """The driver of a Ray run may have no GPU: the workers' device is theirs to check."""
    fake_gpus(monkeypatch, 0)
    check_job(CaptureOptions(model="m", data="d", device="cuda:3", runner="ray"))
    with pytest.raises(DeviceError, match=r"^--device must be one of 'cpu', 'cuda', 'cuda:N'. Got 'tpu'.$"):
        check_job(CaptureOptions(model="m", data="d", device="tpu", runner="ray"))
    with pytest.raises(DeviceError, match=r"^--device cuda:3: torch .* sees no CUDA device here; use cpu$"):
        check_job(CaptureOptions(model="m", data="d", device="cuda:3"))


def test_parse_device_in_the_library():
    with pytest.raises(DeviceError, match=r"^device must be one of 'cpu', 'cuda', 'cuda:N'. Got 3.$"):
        parse_device(3)
    with pytest.raises(DeviceError, match=r"^device must be one of 'cpu', 'cuda', 'cuda:N'. Got 'auto'.$"):
        parse_device("auto")
    assert parse_device("auto", auto=True) == "auto" and parse_device("cpu", auto=True) == "cpu"
    assert isinstance(DeviceError("x"), ValueError)


def test_writer_threads_past_the_stated_bound_are_refused(tmp_path, no_model):
    usage_error(
        write(tmp_path, "--writer-threads", "1000000"),
        "Invalid value for '--writer-threads': --writer-threads: 1000000 is too large (at most 256)",
    )
    with pytest.raises(CaptureError, match=r"^writer_threads must be an int in 1..256 .*Got 1000000.$"):
        CaptureOptions(writer_threads=1_000_000).check()
    with pytest.raises(ValueError, match=r"^io_threads must be an int in 1..256 or None. Got 257.$"):
        WriterOptions(io_threads=257)
    assert WriterOptions(io_threads=256).io_threads == 256


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--temperature", "inf", "'inf' is not a finite number in [0, inf)"),
        ("--temperature", "-0.5", "'-0.5' is not a finite number in [0, inf)"),
        ("--temperature", "nan", "'nan' is not a finite number in [0, inf)"),
        ("--top-p", "0", "'0' is not a finite number in (0, 1]"),
        ("--top-p", "1.01", "'1.01' is not a finite number in (0, 1]"),
        ("--top-p", "-1", "'-1' is not a finite number in (0, 1]"),
        ("--top-p", "nan", "'nan' is not a finite number in (0, 1]"),
    ],
)
def test_sampling_options_are_checked_before_the_model_loads(tmp_path, no_model, option, value, message):
    usage_error(write(tmp_path, "--generate", "4", option, value), f"Invalid value for '{option}': {message}")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": math.inf}, r"^temperature must be a finite number >= 0 \(0: greedy\). Got inf.$"),
        ({"temperature": math.nan}, r"^temperature must be a finite number >= 0 \(0: greedy\). Got nan.$"),
        ({"temperature": -1.0}, r"^temperature must be a finite number >= 0 \(0: greedy\). Got -1.0.$"),
        ({"temperature": 1.0, "top_p": 0.0}, r"^top_p must be a number in \(0, 1\] \(1: no nucleus cut\). Got 0.0.$"),
        ({"temperature": 1.0, "top_p": "0.5"}, r"^top_p must be a number in \(0, 1\] .*Got '0.5'.$"),
    ],
)
def test_sampling_options_in_the_library(kw, message):
    with pytest.raises(CaptureError, match=message):
        CaptureOptions(generate=4, **kw).check()
    CaptureOptions(generate=4, temperature=0.7, top_p=0.9).check()
