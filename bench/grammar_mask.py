"""Per-step cost of structured output in the sampler: filling each constrained row's token
bitmask (xgrammar matcher) and applying the masks to the batch's logits.

    python bench/grammar_mask.py --model DIR --rows 16 --steps 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from shoal.runtime.sample.sampler import Sampler
from shoal.runtime.sample.state import build_sampling_metadata, new_request_state
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.structured.backend import GrammarBackend, apply_token_bitmask
from shoal.runtime.structured.spec import json_schema_spec

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["a", "b", "c"]}},
                         "ok": {"type": "boolean"}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    grammars = GrammarBackend(args.model, vocab, [1, 2])
    cpu = torch.device("cpu")
    spec = json_schema_spec(SCHEMA, "response_format")
    t0 = time.perf_counter()
    grammars.compiled(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3  # includes the first TokenizerInfo build
    t0 = time.perf_counter()
    grammars.compiled(json_schema_spec({**SCHEMA, "title": "other"}, "response_format"))
    recompile_ms = (time.perf_counter() - t0) * 1e3
    states = [new_request_state(SamplingParams(temperature=1.0, structured=spec), [5], [], 0,
                                [1, 2], vocab, cpu, grammars) for _ in range(args.rows)]
    sampler, gen = Sampler(torch.Generator().manual_seed(0)), torch.Generator().manual_seed(0)
    fill, apply, plain = [], [], []
    for _ in range(args.steps):
        live = [s for s in states if s.grammar is not None and not s.grammar.finished]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 5
        t0 = time.perf_counter()
        meta = build_sampling_metadata(live, vocab, cpu)
        t1 = time.perf_counter()
        out = sampler(logits, meta)
        t2 = time.perf_counter()
        assert meta.token_bitmask is not None
        apply_token_bitmask(logits, meta.token_bitmask, meta.bitmask_rows)
        t3 = time.perf_counter()
        fill.append((t1 - t0) / len(live))
        apply.append(t3 - t2)
        plain.append(t2 - t1)
        for s, tok in zip(live, out.sampled_token_ids.tolist(), strict=True):
            s.append(tok)
    print(f"vocab {vocab}, {args.rows} rows, {len(fill)} steps: compile {compile_ms:.1f} ms "
          f"(first, with the vocabulary), {recompile_ms:.1f} ms (another schema); metadata "
          f"incl. mask fill per row median {statistics.median(fill) * 1e6:.0f} us; mask apply "
          f"per step median {statistics.median(apply) * 1e6:.0f} us (the whole sampler call "
          f"{statistics.median(plain) * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
