#!/usr/bin/env python3
"""A load generator for the real-node e2e: real OpenAI completion requests to every
ready address of a Service's EndpointSlices (as kube-proxy would spread them; the
kits run none), from a set number of concurrent clients, optionally held to a set
rate, for a set time. Every failed request is recorded.

    load.py --namespace NS --service SVC --port 8000 --model /model \\
        --concurrency 8 [--rate 4] --duration 60 [--stop-file FILE] --out DIR

Prompts are token IDs (the e2e's model has no tokenizer). Writes DIR/summary.json
(ok, failed, requests and output tokens per second, latency percentiles) and
DIR/failures (one line per failed request), and exits 0 however the requests went:
the caller judges. Python standard library only.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


class Endpoints:
    """The Service's ready addresses, looked up again every second in the background."""

    def __init__(self, namespace, service, kubectl):
        self.namespace, self.service, self.kubectl = namespace, service, kubectl
        self.addresses = []
        self.lock = threading.Lock()
        self.refresh()
        threading.Thread(target=self.loop, daemon=True).start()

    def refresh(self):
        try:
            out = subprocess.run(
                [self.kubectl, "get", "endpointslices", "-n", self.namespace,
                 "-l", f"kubernetes.io/service-name={self.service}", "-o", "json"],
                capture_output=True, text=True, timeout=10, check=True).stdout
            slices = json.loads(out)["items"]
        except (subprocess.SubprocessError, OSError, ValueError, KeyError):
            return
        ready = [e["addresses"][0] for s in slices for e in s.get("endpoints") or []
                 if (e.get("conditions") or {}).get("ready") and e.get("addresses")]
        with self.lock:
            self.addresses = sorted(ready)

    def loop(self):
        while True:
            time.sleep(1)
            self.refresh()

    def pick(self, n):
        with self.lock:
            return self.addresses[n % len(self.addresses)] if self.addresses else None


class Pacer:
    """Hands out start times `1/rate` apart; without a rate, at once."""

    def __init__(self, rate):
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next = time.monotonic()
        self.lock = threading.Lock()

    def wait(self):
        if not self.interval:
            return
        with self.lock:
            at = self.next
            self.next = max(self.next + self.interval, time.monotonic())
        delay = at - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", required=True)
    p.add_argument("--service", required=True)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s at most (0: no limit)")
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--stop-file", help="stop early once this file exists (a load step's end)")
    p.add_argument("--out", required=True)
    p.add_argument("--kubectl", default=os.environ.get("KUBECTL", "kubectl"))
    args = p.parse_args()
    if args.concurrency < 1 or args.duration <= 0 or args.rate < 0:
        sys.exit("error: --concurrency must be at least 1, --duration above 0, --rate not negative")
    os.makedirs(args.out, exist_ok=True)

    endpoints = Endpoints(args.namespace, args.service, args.kubectl)
    pacer = Pacer(args.rate)
    lock = threading.Lock()
    results = {"ok": 0, "failed": 0, "tokens": 0, "latencies": []}
    failures = open(os.path.join(args.out, "failures"), "w")
    start = time.monotonic()
    deadline = start + args.duration

    def fail(why):
        with lock:
            results["failed"] += 1
            failures.write(f"{time.strftime('%H:%M:%S')} {why}\n")
            failures.flush()

    def client(index):
        rng = random.Random(index)
        n = index
        while True:
            pacer.wait()
            if time.monotonic() >= deadline or (args.stop_file and os.path.exists(args.stop_file)):
                return
            n += 1
            address = endpoints.pick(n)
            if address is None:
                fail("no ready address")
                time.sleep(0.5)
                continue
            host = f"[{address}]" if ":" in address else address
            body = json.dumps({
                "model": args.model,
                "prompt": [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
            }).encode()
            request = urllib.request.Request(
                f"http://{host}:{args.port}/v1/completions", data=body,
                headers={"content-type": "application/json"})
            sent = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=args.timeout) as response:
                    answer = json.load(response)
                tokens = answer["usage"]["completion_tokens"]
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
                fail(f"{address}: {e}")
                continue
            with lock:
                results["ok"] += 1
                results["tokens"] += tokens
                results["latencies"].append(time.monotonic() - sent)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    latencies = sorted(results["latencies"])

    def percentile(q):
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else None

    summary = {
        "ok": results["ok"],
        "failed": results["failed"],
        "seconds": round(elapsed, 1),
        "concurrency": args.concurrency,
        "requests_per_second": round(results["ok"] / elapsed, 2),
        "output_tokens_per_second": round(results["tokens"] / elapsed, 1),
        "latency_p50_s": percentile(0.5),
        "latency_p90_s": percentile(0.9),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
