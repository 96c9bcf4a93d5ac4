#!/usr/bin/python3
"""fairscale-cpp vs PyTorch, side by side in one run (fsdp/bench/README.md, "vs PyTorch").

The same model, initial weights, batches and optimizer trained by
  * PyTorch 1.13 (Debian's python3-torch, the same libtorch_cpu.so our binaries link):
      DDP       DistributedDataParallel over gloo + torch.optim.Adam
      ZERO_DDP  DDP + ZeroRedundancyOptimizer(Adam)     (ZeRO-1: what 1.13 can shard on CPU)
  * fairscale-cpp (//fsdp/bench:vs_pytorch_rank, the tcp backend):
      NO_SHARD, FULL_SHARD, SHARD_GRAD_OP   FullyShardedDataParallel, every block its own unit
      OSS_SDP   oss::OSS(Adam) + ShardedDataParallel       (ZeRO-2)
at 1, 2 and 4 ranks on 127.0.0.1, one intra-op thread per rank, interleaved run by run (the
configuration order reverses every repeat), several repeats, medians. The losses of every
configuration must agree with DDP's of the same repeat within --loss_tol, so both sides do the
same work; a mismatch fails the run.

    ./bazelw build -c opt //fsdp/bench:vs_pytorch_rank
    /usr/bin/python3 fsdp/bench/vs_pytorch.py --ranks=1,2,4 --repeats=3

Measured per rank (the slowest rank of each run reported, then the median over repeats):
step time and its parts (forward + loss, backward including the wait for gradient reduction,
optimizer step), what the training thread did over the timed steps (on a CPU; runnable but
waiting for a core; blocked = the rest of the wall time: waiting for communication), the CPU
time of every other thread (communication progress: ProcessGroupGloo's workers, our
communicator's worker), and the peak RSS.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TORCH_CONFIGS = ("DDP", "ZERO_DDP", "torch_unwrapped")
OUR_CONFIGS = ("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "OSS_SDP", "unwrapped")
# Our backends, as a configuration suffix ("FULL_SHARD@ucx-shm"; none: tcp): --backend, the
# environment of the ranks and --comm_options. tcp-socket: tcp without its same-host copies.
BACKENDS = {"tcp": ("tcp", {}, ""),
            "tcp-socket": ("tcp", {}, "tcp.cma_min_bytes=0"),
            "ucx-shm": ("ucx", {"UCX_TLS": "posix,sysv,self"}, ""),
            "ucx-cma": ("ucx", {"UCX_TLS": "posix,sysv,cma,self"}, "")}


def build_model(nn, torch, spec):
    """The PyTorch twin of //examples/gpt:model's Gpt (same names, same ops in the same order)
    or of vs_pytorch_rank.cc's Mlp."""
    F = nn.functional

    class Block(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.ln2 = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            d = c // self.heads
            q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)

            def split(z):
                return z.view(b, t, self.heads, d).transpose(1, 2)

            att = torch.matmul(split(q), split(k).transpose(-2, -1)) / math.sqrt(d)
            future = torch.ones(t, t, dtype=torch.bool).triu(1)
            att = torch.softmax(att.masked_fill(future, -math.inf), -1)
            y = torch.matmul(att, split(v)).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Embeddings(nn.Module):
        def __init__(self, vocab, seq, width):
            super().__init__()
            self.tok = nn.Embedding(vocab, width)
            self.pos = nn.Embedding(seq, width)

        def forward(self, tokens):
            return self.tok(tokens) + self.pos(torch.arange(tokens.size(1)))

    class LmHead(nn.Module):
        def __init__(self, width, vocab):
            super().__init__()
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

        def forward(self, x):
            return self.head(self.ln_f(x))

    class Gpt(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.embed = Embeddings(s["vocab"], s["seq"], s["width"])
            self.n = s["blocks"]
            for i in range(self.n):
                setattr(self, "block%d" % i, Block(s["width"], s["heads"]))
            self.lm_head = LmHead(s["width"], s["vocab"])

        def forward(self, tokens):
            x = self.embed(tokens)
            for i in range(self.n):
                x = getattr(self, "block%d" % i)(x)
            return self.lm_head(x)

    class Mlp(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.n = s["layers"]
            for i in range(self.n):
                setattr(self, "fc%d" % i, nn.Linear(s["width"], s["width"]))

        def forward(self, x):
            for i in range(self.n):
                x = getattr(self, "fc%d" % i)(x)
                if i + 1 < self.n:
                    x = x.relu()
            return x

    return Gpt(spec) if spec["model"] == "gpt" else Mlp(spec)


def loss_of(F, spec, out, y):
    if spec["model"] == "gpt":
        return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    return F.mse_loss(out, y)


def thread_times():
    """{tid: (name, run_s, runq_s)} from /proc/self/task/*/schedstat."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/comm" % tid) as f:
                name = f.read().strip()
            with open("/proc/self/task/%s/schedstat" % tid) as f:
                run, wait = f.read().split()[:2]
        except OSError:
            continue
        out[int(tid)] = (name, int(run) * 1e-9, int(wait) * 1e-9)
    return out


def thread_busy():
    """This thread's CPU time in seconds (exact, unlike schedstat's, which lags by a tick)."""
    return time.thread_time()


def thread_json(before, after):
    main, others = None, []
    for tid, (name, run, wait) in after.items():
        b = before.get(tid, (name, 0.0, 0.0))
        j = {"name": name, "run_s": run - b[1], "runq_s": wait - b[2]}
        if tid == os.getpid():
            main = j
        else:
            others.append(j)
    return {"main": main, "others": others}


def torch_worker(args):
    """One PyTorch rank (RANK, WORLD_SIZE, FS_VS_PYTORCH_DIR from the driver)."""
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = torch.load(args.data)
    spec = data
    dist.init_process_group("gloo", init_method="file://%s/torch_store" % os.environ["FS_VS_PYTORCH_DIR"],
                            rank=rank, world_size=n, timeout=timedelta(minutes=5))
    model = build_model(nn, torch, spec)
    model.load_state_dict(data["params"])
    config = args.config
    if config == "torch_unwrapped":
        wrapped = model
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        wrapped = DDP(model)
        if config == "DDP":
            opt = torch.optim.Adam(wrapped.parameters(), lr=args.lr)
        elif config == "ZERO_DDP":
            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
        else:
            raise SystemExit("unknown torch config " + config)
    inputs, targets = data["inputs"], data["targets"]
    local = inputs.size(1) // n
    losses, step_s, fwd_s, bwd_s, opt_s, blocked_s = [], [], [], [], [], []
    before, window_start = None, None
    for step in range(inputs.size(0)):
        if step == args.warmup:
            before, window_start = thread_times(), time.perf_counter()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            faults_before = ru.ru_minflt + ru.ru_majflt
        x = inputs[step].narrow(0, rank * local, local)
        y = targets[step].narrow(0, rank * local, local)
        b0 = thread_busy()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(nn.functional, spec, wrapped(x), y)
        t1 = time.perf_counter()
        b1 = thread_busy()
        loss.backward()
        t2 = time.perf_counter()
        b2 = thread_busy()
        opt.step()
        t3 = time.perf_counter()
        b3 = thread_busy()
        losses.append(loss.item())
        if step >= args.warmup:
            step_s.append(t3 - t0)
            fwd_s.append(t1 - t0)
            bwd_s.append(t2 - t1)
            opt_s.append(t3 - t2)
            blocked_s.extend([(t1 - t0) - (b1 - b0), (t2 - t1) - (b2 - b1), (t3 - t2) - (b3 - b2)])
    after, window_s = thread_times(), time.perf_counter() - window_start
    ru = resource.getrusage(resource.RUSAGE_SELF)
    faults = ru.ru_minflt + ru.ru_majflt - faults_before
    dist.barrier()
    result = {"losses": losses, "step_s": step_s, "fwd_s": fwd_s, "bwd_s": bwd_s, "opt_s": opt_s, "blocked_s": blocked_s,
              "window_s": window_s, "peak_rss_kib": ru.ru_maxrss, "page_faults": faults,
              "threads": thread_json(before, after)}
    with open(args.out, "w") as f:
        json.dump(result, f)
    # PyTorch 1.13 sometimes aborts in its teardown ("terminate called without an active
    # exception", a gloo thread still joinable) after all the work is done: the process group is
    # destroyed first, and the interpreter's own teardown skipped.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_ticks():
    """(busy, steal, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    steal = v[7] if len(v) > 7 else 0
    total = sum(v[:8])
    return total - idle - steal, steal, total


def write_data(path, spec, steps, seed):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    model = build_model(nn, torch, spec)
    data = dict(spec)
    data["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = spec["global_batch"]
    if spec["model"] == "gpt":
        tokens = torch.randint(spec["vocab"], (steps, b, spec["seq"] + 1))
        data["inputs"] = tokens[:, :, :-1].contiguous()
        data["targets"] = tokens[:, :, 1:].contiguous()
    else:
        data["inputs"] = torch.randn(steps, b, spec["width"])
        data["targets"] = torch.randn(steps, b, spec["width"])
    torch.save(data, path)


def run_config(args, config, n, data_path, work):
    """Runs `config` at `n` ranks; returns the ranks' results (dicts)."""
    run_dir = tempfile.mkdtemp(prefix="%s_%d_" % (config, n), dir=work)
    procs, outs = [], []
    for r in range(n):
        out = os.path.join(run_dir, "rank%d.json" % r)
        outs.append(out)
        env = dict(os.environ, OMP_NUM_THREADS="1", FS_VS_PYTORCH_RANK=str(r), FS_VS_PYTORCH_SIZE=str(n),
                   FS_VS_PYTORCH_DIR=run_dir, RANK=str(r), WORLD_SIZE=str(n), GLOO_SOCKET_IFNAME="lo")
        common = ["--data=" + data_path, "--out=" + out, "--warmup=%d" % args.warmup, "--lr=%g" % args.lr]
        if config in TORCH_CONFIGS:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config=" + config] + common
        else:
            ours, _, backend = config.partition("@")
            backend, backend_env, comm_options = BACKENDS[backend or "tcp"]
            env.update(backend_env)
            cmd = [args.binary, "--config=" + ours, "--backend=" + backend,
                   "--comm_options=" + comm_options] + common
            if ours != "unwrapped" and args.bucket_cap_mb:
                cmd.append("--bucket_cap_mb=%g" % args.bucket_cap_mb)
        log = open(os.path.join(run_dir, "rank%d.log" % r), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    # Every rank is watched at once: once one fails, the others get a short grace to fail too
    # (ours notice a dead peer at once, gloo may not) and are then killed, so a broken run ends
    # in seconds, not at --run_timeout_s.
    deadline = time.time() + args.run_timeout_s
    codes = [None] * n
    while any(c is None for c in codes):
        for r, (p, _) in enumerate(procs):
            if codes[r] is None:
                codes[r] = p.poll()
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.time() + 20)
        if time.time() > deadline:
            for r, (p, _) in enumerate(procs):
                if codes[r] is None:
                    p.kill()
                    p.wait()
                    codes[r] = "killed: still running %s" % (
                        "after another rank failed" if any(c not in (None, 0) for c in codes)
                        else "after %d s" % args.run_timeout_s)
            break
        time.sleep(0.05)
    for _, log in procs:
        log.close()
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if failed:
        detail = "\n".join("rank %d: %s\n%s" % (r, rc, open(os.path.join(run_dir, "rank%d.log" % r)).read()[-3000:])
                           for r, rc in failed)
        raise SystemExit("vs_pytorch: %s at %d ranks failed:\n%s" % (config, n, detail))
    return [json.load(open(o)) for o in outs]


def summarize(ranks, steps):
    """One run: the slowest rank's medians, per-step thread times, losses (mean over ranks)."""
    med = statistics.median
    slow = max(ranks, key=lambda r: med(r["step_s"]))
    main = slow["threads"]["main"]
    per_step = 1.0 / steps
    others = {}
    for t in slow["threads"]["others"]:
        if t["run_s"] > 0:
            others[t["name"]] = others.get(t["name"], 0.0) + t["run_s"] * per_step
    nsteps = len(ranks[0]["losses"])
    return {
        "blocked": [med(slow["blocked_s"][k::3]) for k in range(3)],
        "step": med(slow["step_s"]), "fwd": med(slow["fwd_s"]), "bwd": med(slow["bwd_s"]), "opt": med(slow["opt_s"]),
        "main_run": main["run_s"] * per_step, "main_runq": main["runq_s"] * per_step,
        "main_blocked": (slow["window_s"] - main["run_s"] - main["runq_s"]) * per_step,
        "others": others, "other_cpu": sum(others.values()),
        "rss_mib": max(r["peak_rss_kib"] for r in ranks) / 1024.0,
        "faults": slow["page_faults"] * per_step,
        "losses": [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(nsteps)],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help="worker: result file; driver: also write the table here")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="gpt", choices=["gpt", "mlp"])
    ap.add_argument("--configs", default="DDP,NO_SHARD,FULL_SHARD,ZERO_DDP,OSS_SDP",
                    help="PyTorch's: DDP, ZERO_DDP, torch_unwrapped; ours: NO_SHARD, FULL_SHARD, "
                         "SHARD_GRAD_OP, OSS_SDP, unwrapped, over tcp, or with a suffix @tcp-socket "
                         "(tcp without its same-host copies), @ucx-shm "
                         "(the ucx backend over UCX's shared memory) or @ucx-cma (shared memory + "
                         "cross-memory attach). The first is the baseline. The unwrapped "
                         "ones at n ranks: n independent trainings side by side on the ranks' shares "
                         "(the per-rank compute and core contention without communication; their "
                         "losses are not compared).")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--loss_tol", type=float, default=1e-5)
    ap.add_argument("--bucket_cap_mb", type=float, default=0)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=0, help="default 256 (gpt), 1024 (mlp)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--global_batch", type=int, default=16)
    ap.add_argument("--binary", default="bazel-bin/fsdp/bench/vs_pytorch_rank")
    ap.add_argument("--run_timeout_s", type=int, default=600)
    ap.add_argument("--summarize", default="", help="only print the report of a run's saved results "
                    "(the --out file + .runs.json)")
    args = ap.parse_args()
    if args.worker:
        return torch_worker(args)
    if args.summarize:
        with open(args.summarize) as f:
            saved = json.load(f)
        return report(args, saved["configs"], saved["worlds"], saved["spec"], saved["shape"],
                      saved["header"], {(c, n): v for c, n, v in saved["runs"]})

    configs = args.configs.split(",")
    for c in configs:
        if c not in TORCH_CONFIGS and (c.split("@")[0] not in OUR_CONFIGS or
                                       ("@" in c and c.split("@", 1)[1] not in BACKENDS)):
            raise SystemExit("vs_pytorch: unknown configuration " + c)
    if any(c not in TORCH_CONFIGS for c in configs) and not os.access(args.binary, os.X_OK):
        raise SystemExit("vs_pytorch: %s not found: ./bazelw build -c opt //fsdp/bench:vs_pytorch_rank" % args.binary)
    args.binary = os.path.abspath(args.binary)
    worlds = [int(x) for x in args.ranks.split(",")]
    for n in worlds:
        if args.global_batch % n:
            raise SystemExit("vs_pytorch: the global batch %d is not divisible by %d" % (args.global_batch, n))
    if args.model == "gpt":
        spec = {"model": "gpt", "blocks": args.blocks, "width": args.width or 256, "heads": args.heads,
                "vocab": args.vocab, "seq": args.seq, "global_batch": args.global_batch}
        shape = "GPT: %(blocks)d pre-norm blocks, width %(width)d, %(heads)d heads, vocab %(vocab)d, seq %(seq)d" % spec
    else:
        spec = {"model": "mlp", "layers": args.layers, "width": args.width or 1024, "global_batch": args.global_batch}
        shape = "MLP: %(layers)d x Linear(%(width)d, %(width)d)" % spec

    work = tempfile.mkdtemp(prefix="vs_pytorch_", dir=os.environ.get("TEST_TMPDIR"))
    data_path = os.path.join(work, "data.pt")
    write_data(data_path, spec, args.warmup + args.steps, seed=0)
    load_start = open("/proc/loadavg").read().split()[:3]
    ticks_start = cpu_ticks()
    started = time.time()
    runs = {}  # (config, n) -> [summary per repeat]
    for rep in range(args.repeats):
        order = configs if rep % 2 == 0 else configs[::-1]
        for n in worlds:
            for c in order:
                print("repeat %d, %d ranks, %s..." % (rep + 1, n, c), file=sys.stderr, flush=True)
                runs.setdefault((c, n), []).append(summarize(run_config(args, c, n, data_path, work), args.steps))
    load_end = open("/proc/loadavg").read().split()[:3]
    ticks_end = cpu_ticks()
    d = [b - a for a, b in zip(ticks_start, ticks_end)]
    cpu_note = "CPUs %.0f%% busy, %.1f%% stolen by the hypervisor" % (100.0 * d[0] / max(1, d[2]), 100.0 * d[1] / max(1, d[2]))
    shutil.rmtree(work, ignore_errors=True)

    header = "load average %s at start, %s at end; %s; %d cores; %.0f s" % (
        " ".join(load_start), " ".join(load_end), cpu_note, os.cpu_count(), time.time() - started)
    if args.out:  # the raw results first: a report can be made again from them (--summarize)
        with open(args.out + ".runs.json", "w") as f:
            json.dump({"configs": configs, "worlds": worlds, "spec": spec, "shape": shape, "header": header,
                       "runs": [[c, n, v] for (c, n), v in runs.items()]}, f)
    return report(args, configs, worlds, spec, shape, header, runs)


def report(args, configs, worlds, spec, shape, header, runs):
    med = statistics.median
    base = configs[0]
    fails = []
    lines = [
        "%s; global batch %d split over the ranks; Adam(lr %g); %d warm-up + %d timed steps; "
        "1 intra-op thread per rank; %d interleaved repeats (order reversed every repeat); %s" % (
            shape, spec["global_batch"], args.lr, args.warmup, args.steps,
            len(next(iter(runs.values()))), header),
        "",
        "| ranks | config | step ms (median, min-max) | vs %s (median, min-max of the repeats' ratios) | vs own 1 rank | forward (off-CPU) | backward (off-CPU) | optimizer (off-CPU) "
        "| train thread cpu / runq / blocked ms | other threads cpu ms | page faults | peak RSS MiB | max loss diff vs %s |" % (base, base),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for n in worlds:
        for c in configs:
            if (c, n) not in runs:
                continue
            rs = runs[(c, n)]
            steps_ms = [r["step"] * 1e3 for r in rs]
            vs_base = "-"

            def paired(others):
                """Median (min-max) of this configuration's step over `others`', repeat by repeat."""
                q = [a["step"] / b["step"] for a, b in zip(rs, others)]
                return med(q), "%.3f (%.2f-%.2f)" % (med(q), min(q), max(q))

            if (base, n) in runs and (n == 1 or "unwrapped" not in c):
                rb = runs[(base, n)]
                ratios[(c, n)], vs_base = paired(rb)
                diff = max(abs(x - y) for a, b in zip(rs, rb) for x, y in zip(a["losses"], b["losses"]))
                diff_s = "%.1e" % diff
                if diff > args.loss_tol:
                    fails.append("%s at %d ranks: losses differ from %s's by %.2e > %g" % (c, n, base, diff, args.loss_tol))
                    diff_s += " FAIL"
            else:
                diff_s = "-"
                if (base, n) in runs:
                    vs_base = paired(runs[(base, n)])[1]
            vs_one = "-"
            if n != 1 and (c, 1) in runs:
                ratios[(c, n, "vs1")], vs_one = paired(runs[(c, 1)])
            names = {}
            for r in rs:
                for k, v in r["others"].items():
                    names.setdefault(k, []).append(v)
            other = "%.1f" % (med([r["other_cpu"] for r in rs]) * 1e3)
            if names:
                other += " (" + ", ".join("%s %.1f" % (k, med(v) * 1e3) for k, v in sorted(names.items())) + ")"
            lines.append("| %d | %s | %.1f (%.1f-%.1f) | %s | %s | %.1f (%.1f) | %.1f (%.1f) | %.1f (%.1f) | %.1f / %.1f / %.1f | %s | %.0f | %.0f | %s |" % (
                n, c, med(steps_ms), min(steps_ms), max(steps_ms), vs_base, vs_one,
                med([r["fwd"] for r in rs]) * 1e3, med([r["blocked"][0] for r in rs]) * 1e3,
                med([r["bwd"] for r in rs]) * 1e3, med([r["blocked"][1] for r in rs]) * 1e3,
                med([r["opt"] for r in rs]) * 1e3, med([r["blocked"][2] for r in rs]) * 1e3,
                med([r["main_run"] for r in rs]) * 1e3, med([r["main_runq"] for r in rs]) * 1e3,
                med([r["main_blocked"] for r in rs]) * 1e3, other, med([r["faults"] for r in rs]),
                med([r["rss_mib"] for r in rs]), diff_s))
    lines.append("")
    # The targets (fsdp/bench/README.md), where the run has what they compare. Scaling from 1 to 2
    # ranks is a target on the compute-bound GPT only: the MLP is communication-bound.
    def target(name, value, bound):
        if value is not None:
            lines.append("%s: %.3f (target <= %.2f) %s" % (name, value, bound, "met" if value <= bound else "MISSED"))

    def info(name, value, bound=None):
        if value is not None:
            lines.append("%s: %.3f" % (name, value))

    scaling = target if spec["model"] == "gpt" else info
    bounds = {"NO_SHARD": 0.95, "FULL_SHARD": 1.0}
    ours = [c for c in configs if c not in TORCH_CONFIGS and not c.startswith("unwrapped")]
    if base == "DDP":
        for n in worlds[1:]:
            for c in ours:
                if c.split("@")[0] in bounds:
                    (target if n == 2 else info)("%s / DDP at %d ranks" % (c, n), ratios.get((c, n)),
                                                 bounds[c.split("@")[0]])
    for c in ours:
        scaling("%s 2 ranks / 1 rank" % c, ratios.get((c, 2, "vs1")), 0.6)
    info("DDP 2 ranks / 1 rank (PyTorch)", ratios.get(("DDP", 2, "vs1")))
    for n in worlds[1:]:
        for c in ours:
            if c.split("@")[0] == "OSS_SDP" and (c, n) in runs and ("ZERO_DDP", n) in runs:
                (target if n == 2 else info)(
                    "%s / ZERO_DDP at %d ranks" % (c, n),
                    med([a["step"] / b["step"] for a, b in zip(runs[(c, n)], runs[("ZERO_DDP", n)])]), 1.0)
    table = "\n".join(lines) + "\n"
    sys.stdout.write(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    if fails:
        raise SystemExit("vs_pytorch: " + "; ".join(fails))


if __name__ == "__main__":
    main()
