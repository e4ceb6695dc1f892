"""The README's main job, examples/train_gpt.py: its whole code path for a few steps of a tiny
model (``--tiny``), and the safetensors checkpoint round trip under every recipe (a fresh model
built on ``meta`` and loaded from the file gives the very same logits)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def job():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("train_gpt", None)


def test_main_job_runs_end_to_end(job, tmp_path, capsys):
    rc = job.main(["--tiny", "--recipe", "current", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "Python source" in out and "TransformerLayer 'layer0'" in out
    assert "linear_bias_add" in out  # the fusion plan of one layer is printed
    assert "final held-out loss" in out and "logits identical" in out
    for name in ("loss_current.png", "gpt_current.safetensors", "summary_current.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "loss_current.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary_current.json").read_text())
    assert summary["reload_identical"] is True
    fp32, fp8 = summary["runs"]
    assert len(fp32["train"]) == len(fp8["train"]) == job.TINY.steps
    assert fp32["train"][0] == pytest.approx(fp8["train"][0], rel=0.01)  # same start, same data


def test_fails_when_the_fp8_loss_is_too_high(job, tmp_path, capsys):
    """The exit status: 1 when the FP8 held-out loss ends more than --tolerance above."""
    argv = ["--tiny", "--steps", "2", "--recipe", "none", "--tolerance", "-0.5",
            "--sample-bytes", "1", "--out", str(tmp_path)]  # fmt: skip
    assert job.main(argv) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8", "blockwise"])
def test_checkpoint_round_trip_gives_identical_logits(job, tmp_path, recipe_name):
    cfg = job.replace(job.TINY, steps=2, eval_every=2)
    data = job.ByteData(cfg, "cpu", seed=0)
    rec = job.RECIPES[recipe_name]()
    torch.manual_seed(0)
    model = job.GPT(cfg, device="cpu")
    job.train(model, data, cfg, rec, recipe_name, "cpu")
    path = tmp_path / "gpt.safetensors"
    job.save_checkpoint(model, path, {"config": json.dumps(job.asdict(cfg))})
    assert path.read_bytes()[8:9] == b"{"  # safetensors: a length, then a JSON header
    sd, meta = job.load_checkpoint(path, "cpu")
    if recipe_name == "delayed":  # the recipe state travels as tensors too
        extra = sd["layers.0.layernorm_mlp.fc1._extra_state"]
        assert extra["forward.amax_history"].abs().sum() > 0
    fresh = job.fresh_model(job.Config(**json.loads(meta["config"])), "cpu")
    fresh.load_state_dict(sd, strict=True)
    x, _ = next(data.eval_batches())
    model.eval()
    with torch.no_grad(), job.precision(rec, "cpu"):
        assert torch.equal(model(x), fresh(x))
