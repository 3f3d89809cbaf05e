"""Two gloo ranks, each loading only its shard, give the single-process logits."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("tp_rank_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_match_one_for_every_architecture(tiny_model_dirs, tmp_path):
    # llama tiny has 1 KV head, replicated on both ranks; qwen2/qwen3 have 2, split
    dirs = ",".join(str(d) for d in tiny_model_dirs.values())
    port = str(_free_port())
    commands = [[str(tmp_path / "single.pt"), "0", "1"],
                [str(tmp_path / "tp2.pt"), "0", "2"], [str(tmp_path / "tp2.pt"), "1", "2"]]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), dirs, rank, world, port, out],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for out, rank, world in commands]
    try:
        for p in procs:
            output, _ = p.communicate(timeout=240)
            assert p.returncode == 0, output.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    single, tp2 = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "tp2.pt")
    for model_dir in dirs.split(","):
        assert tp2[model_dir]["kv_heads"] == 1
        for step in ("prefill", "decode"):
            torch.testing.assert_close(tp2[model_dir][step], single[model_dir][step],
                                       rtol=1e-4, atol=1e-4)
