"""A two-level job of one rank inside the test's own process, no process started: the
harness of the ``test_*_in_process.py`` tests.

* a one-rank gloo world (as :mod:`tests.deepspeed_ext.runtime.world_of_one`), torn down
  with DeepSpeed's own ``destroy_process_group`` so that DeepSpeed forgets its groups and
  the next test's engine makes them anew;
* the tiny GPT-MoE engine of ``configs/tiny.yaml`` built as the trainer builds it (one
  rank: every expert here, ZeRO-2), with MoC's two-level mode enabled on it
  (``enable_moc_checkpointing``, a real :class:`deepspeed_ext.two_level.TwoLevel`);
* the node's keeper served on threads of this process (:class:`ThreadKeeper`): the
  keeper's own request handling (:class:`deepspeed_ext.keeper.Keeper`) and persist job
  (:func:`deepspeed_ext.keeper.run_persist_job`), with a loop the test can hold or kill.

Why the backend is looked up at run time (:func:`enable_two_level`): ``TwoLevel``'s
constructor reaches ``keeper.ensure_keeper``, which can spawn the keeper, so the e2e
rule (tests/process_rule.py) would mark every test naming it as one that starts a
process. Here the thread keeper answers first, so ``ensure_keeper`` only attaches to it;
:func:`one_rank_job` checks that the keeper answering is this process, and in the fast
subset the process guard (tests/process_guard.py) fails any test that starts one.
"""

import contextlib
import importlib
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist

import deepspeed_ext.keeper as keeper
from deepspeed_ext.keeper import commits
from deepspeed_ext.runtime import groups
from tests.shm import new_shm_dir

BASE = ["--config", "configs/tiny.yaml", "--data-path", "unused", "--lr-warmup-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--moe-expert-parallel-size", "1", "--zero-stage", "2", "--global-batch-size", "2",
        "--moc-checkpoint", "--moc-two-level", "--moc-commit-timeout", "20"]
"""The trainer's flags of every job here (more per test: :func:`one_rank_job`)."""

ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
"""What a launcher would set for rank 0 of 1 (DeepSpeed reads them)."""


class ThreadKeeper:
    """The node's keeper on threads of this process.

    Requests are answered by :func:`deepspeed_ext.keeper.serve_connection` with a real
    :class:`deepspeed_ext.keeper.Keeper`; its queued jobs run
    :func:`deepspeed_ext.keeper.run_persist_job` (commits in the background, as the
    keeper's). A shutdown request leaves as the keeper does (:func:`deepspeed_ext.keeper.leave`:
    the node's directory removed). :meth:`hold` pauses the persists, :meth:`kill` makes
    the keeper vanish as a SIGKILLed one does: nothing listens any more, and the jobs it
    had not finished are never run.
    """

    def __init__(self, node_dir: str):
        keeper.claim_node_dir(node_dir)  # private, as the keeper requires
        # An earlier test's shutdown closed this process's commit gate.
        commits.reopen_gate()
        self.node_dir = node_dir
        self.keeper = keeper.Keeper(node_dir, idle_timeout_s=600.0)
        self.lines: List[str] = []
        """The keeper's log lines."""
        self.running = threading.Event()
        self.running.set()
        self.dead = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(keeper.socket_path(node_dir))
        self.listener.listen(64)
        self.listener.settimeout(0.05)
        self.threads = [threading.Thread(target=self._serve, daemon=True, name="test-keeper"),
                        threading.Thread(target=self._persist, daemon=True, name="test-persist")]
        for thread in self.threads:
            thread.start()

    def hold(self) -> None:
        """Persist nothing until :meth:`release` (jobs are still taken and queued)."""
        self.running.clear()

    def release(self) -> None:
        self.running.set()

    def kill(self) -> None:
        """Gone at once: the socket closed and removed; queued jobs are dropped."""
        self.dead = True
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(keeper.socket_path(self.node_dir))
        self.running.set()

    def close(self) -> None:
        if not self.dead:
            self.kill()
        self.keeper.jobs.put(None)
        for thread in self.threads:
            thread.join(10)

    def _serve(self) -> None:
        while not self.dead:
            if self.keeper.stop.is_set():  # every queued job done (Keeper.handle)
                if keeper.leave(self.keeper, self.node_dir, self.listener, "shutdown requested"):
                    self.dead = True
                    return
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:  # killed
                return
            threading.Thread(target=keeper.serve_connection, args=(self.keeper, conn),
                             daemon=True).start()

    def _persist(self) -> None:
        while True:
            job = self.keeper.jobs.get()
            try:
                if job is None:
                    return
                self.running.wait()
                if not self.dead:
                    keeper.run_persist_job(job, log=self.lines.append, background_commit=True)
            finally:
                self.keeper.jobs.task_done()


def enable_two_level(engine, config):
    """``deepspeed_ext.enable_moc_checkpointing(engine, config)``, looked up at run time
    (see the module docstring)."""
    return getattr(importlib.import_module("deepspeed_ext.patch"),
                   "enable_moc_checkpointing")(engine, config)


@dataclass
class OneRankJob:
    """What a test drives: the engine, ``engine.moc``, and the job's directories."""

    engine: object
    moc: object
    args: object
    save_dir: str
    shm_dir: str
    keeper: ThreadKeeper

    @property
    def two(self):
        """The two-level backend (``engine.moc.two_level``)."""
        return self.moc.two_level

    @property
    def step(self) -> int:
        return int(self.engine.global_steps)

    def train(self, steps: int = 1) -> None:
        """``steps`` optimizer steps on tokens that depend only on the step."""
        args = self.args
        for _ in range(steps):
            gen = torch.Generator().manual_seed(1000 + self.step)
            tokens = torch.randint(0, 257, (args.micro_batch_size, args.seq_length + 1),
                                   generator=gen)
            pos = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
            lm, aux, counts = self.engine(tokens[:, :-1], pos, tokens[:, 1:])
            self.engine.backward(lm + args.moe_loss_coeff * aux)
            self.engine.step()
            self.moc.observe_tokens(counts.tolist())  # as the trainer does: PEC's token counts

    def save(self, **kwargs) -> bool:
        """A snapshot at the current step (client state ``{"step": step}``)."""
        return self.engine.save_checkpoint(self.save_dir, client_state={"step": self.step},
                                           **kwargs)

    def train_and_save(self, steps: int) -> Dict[int, Dict[str, torch.Tensor]]:
        """Train and save ``steps`` times; the state saved at each step."""
        saved = {}
        for _ in range(steps):
            self.train()
            self.save()
            saved[self.step] = self.state()
        return saved

    def state(self) -> Dict[str, torch.Tensor]:
        """This rank's fp32 masters and moments, by fragment key (copies)."""
        from deepspeed_ext.state import describe_local_state
        return {f.key: f.tensor.detach().clone()
                for f in describe_local_state(self.engine, self.moc.naming)}

    def tag_dir(self, step: int) -> str:
        return os.path.join(self.save_dir, f"global_step{step}")


def same_state(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """The keys whose tensors differ bitwise (or exist in one only)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not torch.equal(a[k], b[k]))


@contextlib.contextmanager
def _environment(values: Dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine(args):
    from megatron.training import jit_ops
    from megatron.training.arguments import padded_vocab_size
    from megatron.training.engine_setup import setup_model_and_optimizer
    from deepspeed_ext.engine.rng import set_seed
    jit_ops.disable_unused_ops()  # no JIT build (a compiler process) in DeepSpeed's init
    set_seed(args.seed)
    args.true_vocab_size = 257  # the trainer's byte-level tokenizer
    args.padded_vocab_size = padded_vocab_size(257, args.make_vocab_size_divisible_by, 1)
    engine, _ = setup_model_and_optimizer(args)
    return engine


@contextlib.contextmanager
def one_rank_job(tmp_path, *flags: str) -> Iterator[OneRankJob]:
    """A one-rank two-level job with the trainer's ``flags`` beyond :data:`BASE`, its
    checkpoints under ``tmp_path/ckpt`` and its shared memory in a fresh directory;
    afterwards its threads stopped, its keeper gone, its memory and world removed."""
    import deepspeed.comm
    from megatron.training.arguments import moc_config_from_args, parse_args, validate_args
    shm, save_dir = new_shm_dir(), str(tmp_path / "ckpt")
    thread_keeper = moc = None
    with _environment(ENV):
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
        try:
            args = parse_args(BASE + ["--moc-shm-dir", shm, "--save", save_dir, *flags])
            validate_args(args, 1)
            engine = _engine(args)
            thread_keeper = ThreadKeeper(keeper.node_directory(shm, 0))
            moc = enable_two_level(engine, moc_config_from_args(args))
            assert keeper.keeper_pid(thread_keeper.node_dir) == os.getpid()
            yield OneRankJob(engine, moc, args, save_dir, shm, thread_keeper)
        finally:
            if moc is not None:
                moc.two_level.abandon()  # its threads stopped; no collective
            if thread_keeper is not None:
                thread_keeper.close()
            shutil.rmtree(shm, ignore_errors=True)
            deepspeed.comm.destroy_process_group()  # DeepSpeed forgets its groups too
            groups.forget_metadata_group()
