"""A bus server in its own process whose main thread is busy while its I/O thread answers
pings; used by test_cross_process.py.

`python` (default): the main thread spins in pure Python, never giving the GIL up of its own
accord, so every reply needs CPython's forced switch. `torch`: the main thread runs forward
passes of a tiny randomly initialised Llama in a loop (one torch thread), as a verifier does.

Prints its endpoint, then works until a line arrives on stdin, then prints how many rounds it
did and exits: the test knows the main thread was busy the whole time it was being served,
without timing anything. A reader thread watches stdin and sets an Event: polling stdin from
the busy loop (select with timeout 0, ~1000 times a second) would release and at once retake
the GIL, and CPython only forces a switch for a waiting thread when no switch happened during
the whole switch interval, so the I/O thread could wait for the GIL for tens of seconds.
"""

import sys
import threading

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import StreamServer, serve_ping


def python_work():
    def spin(stop: threading.Event) -> int:
        rounds, n = 0, 0
        while not stop.is_set():  # an attribute read under the GIL: never releases it
            for _ in range(20):
                n += sum(i * i for i in range(1000))
            rounds += 1
        return rounds

    return spin


def torch_work():
    """Builds the model first (seconds of imports), so the serving starts on a busy thread."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.arange(16).unsqueeze(0)

    def spin(stop: threading.Event) -> int:
        rounds = 0
        with torch.inference_mode():
            while not stop.is_set():
                model(ids)
                rounds += 1
        return rounds

    return spin


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "python"
    work = {"python": python_work, "torch": torch_work}[kind]()
    loop = IOLoop().start()
    srv = StreamServer(loop, SocketFactory(), lambda req: serve_ping(req) or req.fail("x", "y"))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print(srv.endpoint, flush=True)
    rounds = work(stop)
    print(f"spun {rounds}", flush=True)
    loop.stop()


if __name__ == "__main__":
    main()
