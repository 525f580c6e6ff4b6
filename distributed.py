"""Where a run executes: the device and its precision, torchrun / DDP set-up, and stopping on a signal.

The algorithm does not need this module: on one process it reduces to "cpu or cuda, fp32 or bf16". It
guarantees (test_train.py's DDP, torchrun-SIGTERM and SIGKILL tests; test_reliability.py's signal tests):
- torchrun's RANK / WORLD_SIZE / LOCAL_RANK give each process its GPU (NCCL) or a gloo CPU group;
- a dead rank fails the others' next collective at once (one `error (rank N):` line each, by rundir.run_main),
  a frozen one after DDP_TIMEOUT (never a hang), as does a rendezvous that a process never joins (one line),
  and the ranks that wait while rank 0 (or a node with its own --cache_dir) tokenizes a corpus wait up to
  DATA_TIMEOUT on their own group;
- a worker group that `torchrun --max_restarts` restarts meets on keys of its own attempt, not the dead workers'
  (restart_store);
- SIGINT / SIGTERM stop a run between two steps, never inside one, and every rank stops after the same
  step (a tiny gloo all-reduce each step); a second Ctrl-C stops at once (under torchrun it reaches only
  torchrun, which passes on a SIGTERM: the workers still save); a SIGKILLed torchrun takes its workers
  along (Linux: they get SIGTERM and save).
"""
import os
import re
import signal
import sys
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# a frozen rank fails the others' next collective after this long, instead of hanging for good
DDP_TIMEOUT = timedelta(minutes=15)
# ranks > 0 wait while rank 0 trains the tokenizer and tokenizes the corpus, hours for a full
# Wikipedia: those barriers run on their own gloo group with a long timeout (NCCL's default of
# 10 min would kill the job), so the training collectives keep the short one above
DATA_TIMEOUT = timedelta(hours=6)
# a rendezvous still waiting after this says so, once per node: a process of another node that stopped on bad
# input before joining (its --resume not on a shared out_dir) left this one silent for the whole DDP_TIMEOUT
JOIN_NOTE = timedelta(minutes=1)


@dataclass
class Layout:
    """This process's place in the run: rank, world size, and its device."""
    ddp: bool
    rank: int
    world: int
    device: str
    data_group: object = None
    stop_group: object = None

    @property
    def master(self):
        return self.rank == 0

    @property
    def device_type(self):
        return "cuda" if self.device.startswith("cuda") else self.device


def env_int(name):
    """torchrun's RANK, WORLD_SIZE or LOCAL_RANK as an integer; 0 where it is absent or not a count
    (torchrun_problem says so, in config.validate)."""
    value = os.environ.get(name, "").strip()
    return int(value) if re.fullmatch(r"[0-9]+", value) else 0


def torchrun_problem():
    """What is wrong with torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or None: torchrun sets all three, but a
    stray `export RANK=0` or a hand-made launch may set some (a KeyError from setup before)."""
    if "RANK" not in os.environ:
        return None  # one process
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if name not in os.environ:
            return (f"RANK is set but {name} is not: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK together "
                    f"(unset RANK to run one process)")
        if not re.fullmatch(r"[0-9]+", os.environ[name].strip()):
            return f"{name}={os.environ[name]!r}: torchrun's {name} is a count (0, 1, ...)"
    if env_int("RANK") >= env_int("WORLD_SIZE"):
        return f"RANK={env_int('RANK')} with WORLD_SIZE={env_int('WORLD_SIZE')}: RANK must be below WORLD_SIZE"
    return None


def restart_note():
    """Across nodes each torchrun counts its own restarts (one that restarted on a failure, another on the changed
    membership keeps its count), so the attempt's keys (restart_store) can differ between nodes: a node behind
    then meets the dead workers' keys, as every restart did before restart_store (untried across machines)."""
    if shared_store() and env_int("TORCHELASTIC_MAX_RESTARTS") and env_int("LOCAL_WORLD_SIZE") < env_int("WORLD_SIZE"):
        return (f"note: torchrun --max_restarts {os.environ['TORCHELASTIC_MAX_RESTARTS']} across nodes: the workers of "
                f"a restart meet on keys named by their node's restart count, and where the nodes' counts differ a "
                f"restart can hang or fail (pytorch issue 135712); with --rdzv-backend c10d, "
                f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node gives each restart a new store")
    return None


def shared_store():
    """Whether torchrun's workers meet in its agent's TCPStore, which outlives a restart of the workers: the static
    rendezvous (--master_addr / --node_rank) and, from torch 2.4, the c10d one (--standalone, --rdzv-backend c10d)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_store(world):
    """The store the workers meet in, or None for torchrun's own (env://). torchrun's shared rendezvous store keeps
    what the workers of an attempt wrote (each rank's gloo address, NCCL's id) when --max_restarts starts new ones:
    a restarted worker that read a dead one's address failed its rendezvous in a traceback, using up a restart, or
    hung in connecting (6 hours for the data group's timeout). On one node every worker restarts together, so the
    restart count names the attempt; across nodes the counts can differ (restart_note says so)."""
    if not shared_store():
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], env_int("MASTER_PORT"), world, is_master=False, timeout=DDP_TIMEOUT)
    return dist.PrefixStore(f"bertcl/attempt_{env_int('TORCHELASTIC_RESTART_COUNT')}", store)


def setup(cfg):
    """The device (--device, or the best one present) and, under torchrun, the process group."""
    device = cfg.device if cfg.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")
    if "RANK" not in os.environ:
        return Layout(ddp=False, rank=0, world=1, device=device)
    rank, world, local_rank = (env_int(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if sys.platform == "linux":  # a SIGKILLed torchrun leaves its workers training: SIGTERM them (they save)
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    at = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    note = threading.Timer(JOIN_NOTE.total_seconds(), lambda: print(
        f"rank {rank}: waiting for all WORLD_SIZE={world} processes to join torchrun's rendezvous at {at} (one that "
        f"stopped on an error says why on its own node); giving up after {DDP_TIMEOUT}", file=sys.stderr, flush=True))
    note.daemon = True
    if local_rank == 0:
        note.start()
    restarts = restart_note()
    if rank == 0 and restarts:
        print(restarts, flush=True)
    try:
        store = restart_store(world)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo", timeout=DDP_TIMEOUT,
                                **({} if store is None else dict(store=store, rank=rank, world_size=world)))
    except dist.DistError as e:  # after DDP_TIMEOUT: a process that never started, another MASTER_ADDR / MASTER_PORT
        why = str(e).strip().splitlines()[0].rstrip(".")
        raise ValueError(f"torchrun's rendezvous at {at} failed ({why}): all WORLD_SIZE={world} processes must start, "
                         f"with the same MASTER_ADDR and MASTER_PORT (one that stopped on an error before joining "
                         f"says why on its own node)") from None
    finally:
        note.cancel()
    return Layout(ddp=True, rank=rank, world=world, device=device,
                  data_group=dist.new_group(backend="gloo", timeout=DATA_TIMEOUT),
                  stop_group=dist.new_group(backend="gloo", timeout=DDP_TIMEOUT))  # agreeing on a stop, on the CPU


def rank0_first(layout, prepare):
    """prepare() on rank 0, then on the other ranks (which then read rank 0's token cache). Every rank leaves
    once all have their data, still under DATA_TIMEOUT: another node with a --cache_dir of its own tokenizes
    the corpus itself, for hours, while rank 0 would wait in DDP's set-up (DDP_TIMEOUT)."""
    if layout.ddp and not layout.master:
        data_barrier(layout, "rank 0 stopped while preparing the data")
    result = prepare()
    if layout.ddp and layout.master:
        data_barrier(layout, "another rank stopped")  # the others start theirs
    if layout.ddp:  # and every rank waits for the slowest
        data_barrier(layout, "another rank stopped while preparing its data")
    return result


def data_barrier(layout, who):
    try:
        dist.barrier(group=layout.data_group)
    except RuntimeError:  # that rank exited on bad input (its error line says why), or took over DATA_TIMEOUT
        raise ValueError(f"{who} (its error line says why), or took over {DATA_TIMEOUT}") from None


def every_rank(layout, value):
    """`value` of each rank, in rank order (gathered on the gloo data group: any object, any device)."""
    if not layout.ddp:
        return [value]
    values = [None] * layout.world
    dist.all_gather_object(values, value, group=layout.data_group)
    return values


def lost_peer(error):
    """The first sentence of `error` if it is a collective failing because another process of the run is gone
    (killed, out of memory, a lost node): gloo's "Connection reset by peer", NCCL's ncclRemoteError. Else None:
    this process's own errors (mismatched shapes; out of memory is rundir.out_of_memory's line) keep their traceback."""
    if int(os.environ.get("WORLD_SIZE", 1)) < 2 or not isinstance(error, RuntimeError):
        return None
    line = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().split("\n")[0])  # gloo's [source.cc:537] prefix
    if re.search(r"\bby peer\b|ncclRemoteError|remote process", str(error), re.IGNORECASE):
        return line.split(". ")[0]
    return None


def wrap(layout, trainer):
    return torch.nn.parallel.DistributedDataParallel(trainer) if layout.ddp else trainer


def no_sync(layout, trainer, last_micro_step):
    """Gradients are all-reduced on the last micro-step only."""
    return trainer.no_sync() if layout.ddp and not last_micro_step else nullcontext()


def mean_over_ranks(layout, metrics):
    """The global batch's mean of each logged value, not rank 0's share of it."""
    if not layout.ddp:
        return metrics
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=layout.device) for v in metrics.values()])
    dist.all_reduce(values)
    return dict(zip(metrics, values / layout.world))


def first_across_ranks(layout, value):
    """The smallest of a device tensor over all ranks (the first bad step), so that all ranks stop together."""
    value = value.clone()
    if layout.ddp:
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value)


def close(layout):
    if layout.ddp:
        dist.destroy_process_group()


def precision(cfg, layout):
    """(dtype name, autocast context, GradScaler): --dtype auto is bf16 from Ampere on, fp16 with a loss
    scaler on older GPUs, fp32 on a CPU."""
    dtype, device_type = cfg.dtype, layout.device_type
    if dtype == "auto":
        # bf16 from Ampere on; a V100 / T4 only emulates it (slowly), so it gets fp16 and a GradScaler
        bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bf16" if bf16 else "fp16" if device_type == "cuda" else "fp32"
    if device_type == "cpu" and dtype != "fp32" and layout.master:
        print(f"note: --dtype {dtype} on a CPU without AVX512-BF16/AMX is slower than fp32 (4x in a smoke run on a "
              f"2-core AVX2 CPU); --dtype auto picks fp32 on a CPU")
    ptdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    autocast = nullcontext() if dtype == "fp32" else torch.autocast(device_type, dtype=ptdtype)
    return dtype, autocast, torch.amp.GradScaler(device_type, enabled=dtype == "fp16")


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (what schedulers send before SIGKILL) stop the run between two steps:
    `stopping()` turns true after the step in flight. A second Ctrl-C raises KeyboardInterrupt at once
    (a terminal's Ctrl-C reaches torchrun's workers only through torchrun, as one SIGINT then a SIGTERM);
    a second SIGTERM is ignored (the scheduler and torchrun both send one; it must not abort the save).
    SIGHUP (the terminal closed: an ssh session lost without nohup or tmux) stops it as SIGTERM does,
    unless it is ignored already (nohup). Used as a context manager: the previous handlers come back on
    exit, unless a stop was seen (then a late repeated SIGTERM keeps being ignored while the process exits;
    rundir.run_main puts the process's own back when it returns, for a caller that goes on). In a thread other
    than the main one it sets none: no signal stops such a run."""

    def __init__(self, layout):
        self.layout, self.received = layout, []

    def __enter__(self):
        self.handlers = {}
        if threading.current_thread() is not threading.main_thread():  # a run in a thread (a notebook's background
            return self  # run): Python takes signals in the main thread only, so none stops this run (nor can be set)
        stops = [signal.SIGINT, signal.SIGTERM]
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:  # not Windows; not nohup
            stops.append(signal.SIGHUP)
        self.handlers = {s: signal.signal(s, self.on_signal) for s in stops}
        return self

    def __exit__(self, *exc):
        if not self.received:
            for s, handler in self.handlers.items():
                if handler is not None:  # None: one set outside Python (an embedding program), which cannot be set back
                    signal.signal(s, handler)

    def on_signal(self, signum, frame):
        if self.received and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        if not self.received:
            self.received.append(signum)

    @staticmethod
    def process_handlers():
        """The process's own handlers of the stop signals, for put_back (rundir.run_main): a stopped run leaves its own
        installed, but main() called from Python (a notebook, a loop of runs) goes on after it."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s}

    @staticmethod
    def put_back(handlers):
        """After the run: the process's handlers again (the next cell's Ctrl-C, a later run's SIGHUP, Jupyter's
        SIGTERM), the console flushed first (a repeated SIGTERM may now end the process before its own flush)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        for s, handler in handlers.items():
            if handler is not None:  # None: one set outside Python, which cannot be set back
                signal.signal(s, handler)

    @property
    def name(self):  # None when no signal came
        return signal.Signals(self.received[0]).name if self.received else None

    @property
    def exit_code(self):
        """0, or 128 + the signal's number, as a shell reports a process that a signal stopped."""
        return 128 + self.received[0] if self.received else 0

    def stopping(self):
        # under DDP a signal reaches the ranks at different moments: they agree (a tiny gloo all-reduce on
        # the CPU, no GPU sync) so that all stop after the same step; one going on would hang in all-reduce.
        # Every step: torchrun kills its workers 30 s after passing on a SIGTERM
        if not self.layout.ddp:
            return bool(self.received)
        flag = torch.tensor([len(self.received)])
        dist.all_reduce(flag, group=self.layout.stop_group)
        if flag.item() and not self.received:
            self.received.append(signal.SIGTERM)
        return bool(flag.item())
