"""The benchmark's final table, with the issue's three targets checked from the numbers."""

from __future__ import annotations

ATTENTION_TOLERANCE = 0.05  # bf16 outputs of unit-variance attention: rounding is ~1e-2


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _section_error(name: str, result: dict | None) -> str | None:
    if result is None:
        return f"{name}: no result"
    if "error" in result:
        return f"{name}: ERROR {result['error']}"
    return None


def render_env(env: dict) -> list[str]:
    return [
        "== environment",
        f"device {env.get('device')} | python {env.get('python')} | torch {env.get('torch')} | "
        f"triton {env.get('triton')} | flashinfer installed: {env.get('flashinfer_installed')}",
        f"device copy bandwidth (read+write): {_fmt(env.get('copy_bandwidth_gbps'), '.0f')} GB/s",
    ]


def render_attention(att: dict) -> list[str]:
    lines = [f"== attention, one layer: {att.get('shapes')}",
             f"{'case/backend':<22}{'max|err|':>12}{'us/layer':>12}{'vs flashinfer':>15}"]
    rows = att.get("rows", {})
    for key, row in rows.items():
        if "error" in row:
            lines.append(f"{key:<22}  ERROR {row['error'][:100]}")
            continue
        case = key.split("/")[0]
        fi = rows.get(f"{case}/flashinfer", {}).get("us_per_layer")
        ratio = row["us_per_layer"] / fi if fi else None
        lines.append(f"{key:<22}{_fmt(row['max_abs_error']):>12}{_fmt(row['us_per_layer'], '.1f'):>12}"
                     f"{_fmt(ratio, '.2f'):>15}")
    return lines


def render_decode(dec: dict) -> list[str]:
    lines = [f"== decode step ({dec.get('model')}, context {dec.get('context_len')} tokens/request, "
             f"attention {dec.get('backends')})",
             f"{'batch':>6}{'eager ms':>11}{'graphs ms':>11}{'replay ms':>11}{'floor ms':>10}"
             f"{'graphs/floor':>14}{'eager/graphs':>14}{'same tokens':>13}"]
    for row in dec.get("rows", []):
        eager, graphs, floor = row.get("eager_ms"), row.get("graphs_ms"), row.get("floor_ms")
        lines.append(
            f"{row['batch']:>6}{_fmt(eager, '.2f'):>11}{_fmt(graphs, '.2f'):>11}"
            f"{_fmt(row.get('replay_ms'), '.2f'):>11}{_fmt(floor, '.2f'):>10}"
            f"{_fmt(graphs / floor if graphs and floor else None, '.2f'):>14}"
            f"{_fmt(eager / graphs if eager and graphs else None, '.2f'):>14}"
            f"{_fmt(row.get('same_tokens')):>13}"
        )
    for key, value in (dec.get("capture") or {}).items():
        if key.endswith("_error"):
            lines.append(f"{key[:-6]}  ERROR {str(value)[:100]}")
        elif value is not None:
            lines.append(f"{key}: graph capture took {_fmt(value, '.1f')} s")
    return lines


def render_throughput(thr: dict) -> list[str]:
    lines = [f"== offline throughput ({thr.get('workload')})",
             f"{'mode':<10}{'requests':>9}{'out tokens':>12}{'seconds':>9}{'out tok/s':>11}"]
    for mode, row in thr.get("rows", {}).items():
        if "error" in row:
            lines.append(f"{mode:<10}  ERROR {row['error'][:100]}")
            continue
        note = " (partial: time cap)" if row.get("partial") else ""
        lines.append(f"{mode:<10}{row['requests']:>9}{row['output_tokens']:>12}"
                     f"{_fmt(row['seconds'], '.1f'):>9}{_fmt(row['output_tok_s'], '.0f'):>11}{note}")
    return lines


def targets(results: dict) -> list[str]:
    lines = ["== targets"]
    dec = results.get("decode") or {}
    # off CUDA both modes run eagerly: their ratio says nothing about graphs
    rows = {r["batch"]: r for r in dec.get("rows", [])} if dec.get("device") == "cuda" else {}
    b64 = rows.get(64, {})
    if b64.get("graphs_ms") and b64.get("floor_ms"):
        ratio = b64["graphs_ms"] / b64["floor_ms"]
        lines.append(f"decode b64 with graphs within 2x of floor: {'PASS' if ratio <= 2 else 'FAIL'} ({ratio:.2f}x)")
    else:
        lines.append("decode b64 with graphs within 2x of floor: not measured")
    b1 = rows.get(1, {})
    if b1.get("graphs_ms") and b1.get("eager_ms"):
        speedup = b1["eager_ms"] / b1["graphs_ms"]
        lines.append(f"graphs >= 2x eager at batch 1 (0.6B): {'PASS' if speedup >= 2 else 'FAIL'} ({speedup:.2f}x)")
    else:
        lines.append("graphs >= 2x eager at batch 1 (0.6B): not measured")
    att = (results.get("attention") or {}).get("rows", {})
    ratios = []
    for case in sorted({key.split("/")[0] for key in att}):
        tri = att.get(f"{case}/triton", {}).get("us_per_layer")
        fi = att.get(f"{case}/flashinfer", {}).get("us_per_layer")
        if tri and fi:
            ratios.append((case, tri / fi))
    if ratios:
        worst = max(r for _, r in ratios)
        detail = ", ".join(f"{c} {r:.2f}x" for c, r in ratios)
        lines.append(f"triton within 1.5x of flashinfer: {'PASS' if worst <= 1.5 else 'FAIL'} ({detail})")
    else:
        lines.append("triton within 1.5x of flashinfer: n/a (flashinfer not run)")
    errors = {key: row["max_abs_error"] for key, row in att.items() if "max_abs_error" in row}
    if errors:
        worst_key = max(errors, key=lambda key: errors[key])
        ok = errors[worst_key] <= ATTENTION_TOLERANCE
        lines.append(f"attention matches the reference within {ATTENTION_TOLERANCE:g}: "
                     f"{'PASS' if ok else 'FAIL'} (worst {worst_key} {errors[worst_key]:.3g})")
    lines.insert(4, _decode_8b_target(results))  # the correctness line stays last
    return lines


def _decode_8b_target(results: dict) -> str:
    dec8 = results.get("decode8b") or {}
    b1_8b = {r["batch"]: r for r in dec8.get("rows", [])}.get(1, {}) \
        if dec8.get("device") == "cuda" else {}
    if b1_8b.get("graphs_ms") and b1_8b.get("floor_ms"):
        ratio = b1_8b["graphs_ms"] / b1_8b["floor_ms"]
        return (f"decode 8B b1 with graphs within 1.3x of the HBM floor: "
                f"{'PASS' if ratio <= 1.3 else 'FAIL'} ({ratio:.2f}x)")
    return "decode 8B b1 with graphs within 1.3x of the HBM floor: not measured"


def render_kernels(ker: dict) -> list[str]:
    lines = [f"== kernels ({ker.get('shape')}): copy {_fmt(ker.get('copy_bandwidth_gbps'), '.0f')}"
             f" GB/s (read+write), GEMM {_fmt(ker.get('gemm_tflops'))} TFLOP/s",
             f"{'batch':>6}{'context':>9}{'splits':>7}{'us':>10}{'floor us':>10}{'x floor':>9}"
             f"{'no-split us':>13}{'max|err|':>10}"]
    for row in ker.get("rows", []):
        lines.append(f"{row['batch']:>6}{row['context']:>9}{row['splits']:>7}"
                     f"{_fmt(row.get('us'), '.1f'):>10}{_fmt(row.get('floor_us'), '.1f'):>10}"
                     f"{_fmt(row.get('x_floor'), '.2f'):>9}{_fmt(row.get('no_split_us'), '.1f'):>13}"
                     f"{_fmt(row.get('max_abs_err')):>10}")
    prefill = ker.get("prefill")
    if prefill:
        lines.append(f"prefill attention, {prefill['tokens']} tokens causal: "
                     f"{_fmt(prefill['ms'], '.2f')} ms, {_fmt(prefill['tflops'])} TFLOP/s")
    return lines


def render_serving(srv: dict) -> list[str]:
    lines = [f"== engine, requests in flight ({srv.get('model')}; {srv.get('workload')})",
             f"{'in flight':>10}{'requests':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'ITL p50':>9}{'ITL p99':>9}  (ms)"]
    for row in srv.get("rows", []):
        lines.append(f"{row['concurrency']:>10}{row['requests']:>9}{_fmt(row['output_tok_s'], '.0f'):>11}"
                     f"{_fmt(row.get('ttft_p50_ms'), '.1f'):>10}{_fmt(row.get('ttft_p99_ms'), '.1f'):>10}"
                     f"{_fmt(row.get('itl_p50_ms'), '.2f'):>9}{_fmt(row.get('itl_p99_ms'), '.2f'):>9}")
    base = srv.get("transformers") or {}
    if "error" in base:
        lines.append(f"transformers generate_batch: ERROR {base['error'][:150]}")
    elif base:
        engine = {r["concurrency"]: r for r in srv.get("rows", [])}.get(base["requests"], {})
        ratio = engine.get("output_tok_s", 0) / base["output_tok_s"] if base["output_tok_s"] else None
        lines.append(f"transformers generate_batch, {base['requests']} requests: "
                     f"{_fmt(base['output_tok_s'], '.0f')} out tok/s; engine at "
                     f"{base['requests']} in flight: {_fmt(ratio, '.2f')}x (target >= 3x)")
    return lines


def render_table(results: dict) -> str:
    lines: list[str] = []
    renderers = {"env": render_env, "kernels": render_kernels, "attention": render_attention,
                 "decode": render_decode, "decode8b": render_decode,
                 "serving": render_serving, "throughput": render_throughput}
    for name, render in renderers.items():
        result = results.get(name)
        error = _section_error(name, result)
        if error:
            lines.append(error)
        if result and set(result) - {"error", "seconds"}:  # partial numbers of a failed section
            lines += render(result)
        lines.append("")
    lines += targets(results)
    return "\n".join(lines)
