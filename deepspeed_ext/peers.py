"""Snapshot redundancy between nodes: the peer store and its background transport.

Used by :class:`deepspeed_ext.two_level.TwoLevel` when ``--moc-redundancy`` is not
``none``; placement, coding and rebuild plans are in :mod:`deepspeed_ext.policy.redundancy`.

Transport: a separate gloo process group (host memory to host memory, also when the
training group is NCCL), driven by one background thread per rank. Every rank hands
the thread each snapshot in the same order (:meth:`PeerRedundancy.protect`, from the
snapshot copy thread once the slot is complete, or with no image when its copy
failed), so the point-to-point messages of all ranks pair up without any coordination
in the training loop. The thread writes what it receives into its node's shared memory
(:class:`PeerStore`); a piece counts only once its ``.json`` exists (written last,
atomically), so a snapshot is *protected* exactly when its copies or parities are
complete. Training never waits for it, except when a snapshot slot it still reads is
the only one free for the next snapshot (then the wait is logged).

Recovery (:meth:`PeerRedundancy.rebuild`, every rank, from ``TwoLevel.load``): the
plan's transfers run in one global order with blocking sends and receives (each
involves two ranks, and both meet it at the same place in the order, so they cannot
deadlock); a rebuilt snapshot is written into the rank's own slot and published, after
which the ordinary memory recovery reads it.
"""

import json
import logging
import os
import re
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext.format.storage import atomic_write_json
from deepspeed_ext.policy import redundancy as rd
from deepspeed_ext.private_dir import make_private_dir, open_private
from deepspeed_ext.snapshot import image_end

logger = logging.getLogger(__name__)

KEEP = 2
"""Protected steps kept per source: the newest, and the one before it while the newest
is still being protected."""

MAX_RECORD_BYTES = 256 << 20
"""Longest piece record read (it holds the snapshots' layout metadata)."""

_NAME = re.compile(r"^(replica-r(\d+)|parity)-s(\d+)\.json$")


class PeerStore:
    """What one rank holds for its peers, under ``<node dir>/peers/rank<R>/``:
    ``replica-r<SRC>-s<STEP>.img/.json`` (a copy of rank SRC's snapshot of STEP) and
    ``parity-s<STEP>.img/.json`` (this rank's parity of its stripe at STEP). Only the
    rank that owns the directory writes it."""

    def __init__(self, node_dir: str, rank: int, keep: int = KEEP):
        self.node_dir = node_dir
        self.dir = os.path.join(node_dir, "peers", f"rank{rank:05d}")
        self.keep = keep

    def base(self, kind: str, step: int, source: int = -1) -> str:
        name = f"replica-r{source:05d}" if kind == "replica" else "parity"
        return os.path.join(self.dir, f"{name}-s{step}")

    def allocate(self, base: str, nbytes: int) -> torch.Tensor:
        """A shared-memory uint8 tensor of ``nbytes`` for a piece being received; its old
        record is removed first, so a piece cut off half-way is never taken as complete."""
        make_private_dir(self.dir, root=self.node_dir)
        try:
            os.remove(base + ".json")
        except FileNotFoundError:
            pass
        fd = open_private(base + ".img", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return torch.from_file(base + ".img", shared=True, size=max(nbytes, 1),
                               dtype=torch.uint8)[:nbytes]

    def publish(self, base: str, record: Dict[str, Any]) -> None:
        """Mark a received piece complete (its record, atomically, last).

        Raises:
            FileNotFoundError: the node's memory was wiped meanwhile; the directory is
                not recreated with the umask's mode (it must stay private).
        """
        atomic_write_json(base + ".json", record, make_parent=False)

    def record(self, base: str) -> Dict[str, Any]:
        """A piece's record (bounded read, never through a link).

        Raises:
            OSError, ValueError: missing, too long, or not a JSON object.
        """
        with os.fdopen(open_private(base + ".json", os.O_RDONLY), "rb") as f:
            data = f.read(MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"{base}.json is longer than {MAX_RECORD_BYTES} bytes")
        try:
            record = json.loads(data)
        except RecursionError:
            raise ValueError(f"{base}.json is nested too deeply") from None
        if not isinstance(record, dict):
            raise ValueError(f"{base}.json is not a JSON object")
        return record

    def read(self, base: str, nbytes: int) -> torch.Tensor:
        """The piece's bytes, mapped (copy-on-write: never changes the file)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(base + ".img", shared=False, size=nbytes, dtype=torch.uint8)

    def holdings(self) -> Tuple[Dict[int, Set[int]], Dict[int, int]]:
        """``({source: steps of complete copies}, {step: chunk bytes of complete parities})``;
        a record whose image is missing or short (memory lost under it) does not count."""
        replicas: Dict[int, Set[int]] = {}
        parities: Dict[int, int] = {}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return replicas, parities
        for name in names:
            match = _NAME.match(name)
            if not match:
                continue
            base = os.path.join(self.dir, name[:-len(".json")])
            try:
                record = self.record(base)
                if os.path.getsize(base + ".img") < record["nbytes"]:
                    continue
            except (OSError, ValueError, KeyError, TypeError):
                continue
            step = int(match.group(3))
            if match.group(2) is not None:
                replicas.setdefault(int(match.group(2)), set()).add(step)
            else:
                parities[step] = int(record["nbytes"])
        return replicas, parities

    def prune(self) -> None:
        """Keep the newest ``keep`` steps per source and of the parities."""
        replicas, parities = self.holdings()
        doomed = [self.base("replica", s, src) for src, steps in replicas.items()
                  for s in sorted(steps)[:-self.keep]]
        doomed += [self.base("parity", s) for s in sorted(parities)[:-self.keep]]
        for base in doomed:
            for suffix in (".json", ".img"):  # the record first: never a record without bytes
                try:
                    os.remove(base + suffix)
                except FileNotFoundError:
                    pass

    def host_bytes(self) -> int:
        try:
            return sum(os.path.getsize(os.path.join(self.dir, n)) for n in os.listdir(self.dir)
                       if n.endswith(".img"))
        except OSError:
            return 0


def _blob(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


class PeerRedundancy:
    """One rank's side of the redundancy; created by every rank, in the same order (the
    constructor creates a process group)."""

    def __init__(self, spec: rd.RedundancySpec, topo: rd.Topology, node_dir: str,
                 timeout_s: float = 600.0):
        self.spec, self.topo = spec, topo
        self.rank = dist.get_rank()
        # Its own group: the training group may be NCCL, and its collectives (and the
        # metadata group's, on the main thread) must never queue behind (or interleave
        # with) redundancy traffic from another thread.
        from deepspeed_ext.runtime.groups import new_host_group
        self.group = new_host_group(timedelta(seconds=timeout_s))
        self.store = PeerStore(node_dir, self.rank)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-redundancy")
        self.jobs: Dict[int, Future] = {}
        """slot -> its protection job (the slot must not be reused until it is done)."""
        self.failed: Optional[str] = None
        self.protected: List[Tuple[int, int, float]] = []
        """(step, bytes this rank sent, seconds) per protected snapshot."""
        self._lock = threading.Lock()

    # -- protection (background thread) -----------------------------------------------

    def protect(self, step: int, slot: int, image: Optional[torch.Tensor],
                meta: Optional[Dict[str, Any]]) -> None:
        """Queue the protection of one snapshot (``image`` None: this rank's copy failed;
        it still takes part so that its peers' messages pair up). Called by the snapshot
        copy thread of every rank, for every snapshot, in step order."""
        self.jobs[slot] = self.pool.submit(self._protect, step, image, meta)

    def busy_slots(self) -> Set[int]:
        return {slot for slot, job in self.jobs.items() if not job.done()}

    def wait_slots(self) -> float:
        """Wait for every queued protection; returns the seconds waited."""
        start = time.perf_counter()
        for job in list(self.jobs.values()):
            job.result()
        return time.perf_counter() - start

    def _protect(self, step, image, meta) -> None:
        # Every rank takes part in every protection, even after one of its own failed:
        # a rank that stopped would leave its peers waiting for its messages until the
        # group's timeout, and their snapshots (and so training) behind them.
        start = time.perf_counter()
        try:
            data = json.dumps(meta).encode() if meta is not None else b""
            if self.spec.mode == "replicate":
                sent = self._replicate(step, image, data)
            else:
                sent = self._erasure(step, image, data)
            self.store.prune()
        except Exception as e:
            traceback.print_exc()
            if self.failed is None:
                logger.warning(
                    f"[moc] rank {self.rank}: WARNING: snapshot redundancy failed at step "
                    f"{step} ({type(e).__name__}: {e}); what this rank holds for its peers "
                    f"may lack that step (storage still has what was persisted)")
            self.failed = f"{type(e).__name__}: {e}"
            return
        seconds = time.perf_counter() - start
        with self._lock:
            self.protected.append((step, sent, seconds))
        if self.rank == 0 and len(self.protected) == 1:
            logger.info(f"[moc] redundancy ({self.spec.describe()}): snapshot of step {step} "
                        f"protected; rank 0 sent {sent / 2**20:.2f} MiB in {seconds:.3f} s "
                        f"({sent / 2**20 / max(seconds, 1e-9):.0f} MiB/s)")

    def _exchange(self, sends: List[Tuple[torch.Tensor, int]],
                  recvs: List[Tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive (non-empty ones), then wait for all."""
        works = [dist.isend(t, dst, group=self.group) for t, dst in sends if t.numel()]
        works += [dist.irecv(t, src, group=self.group) for t, src in recvs if t.numel()]
        for work in works:
            work.wait()

    def _landing(self, base: str, nbytes: int, errors: List[str]) -> Tuple[torch.Tensor, bool]:
        """Where to receive ``nbytes`` for ``base``: the store's buffer, or scratch memory
        when the store cannot allocate it (its node's memory full), so that the messages
        the peers send are still received and the pairing of later ones holds; ``errors``
        collects why (raised once the exchange is done)."""
        try:
            return self.store.allocate(base, nbytes), True
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
            return torch.empty(nbytes, dtype=torch.uint8), False

    def _replicate(self, step: int, image: Optional[torch.Tensor], data: bytes) -> int:
        nbytes = image.numel() if image is not None else -1
        targets = rd.replica_targets(self.rank, self.topo, self.spec.replicas)
        sources = rd.replica_sources(self.rank, self.topo, self.spec.replicas)
        sent, errors = 0, []
        for dst, src in zip(targets, sources):
            header = torch.tensor([step, nbytes, len(data)], dtype=torch.int64)
            theirs = torch.zeros(3, dtype=torch.int64)
            self._exchange([(header, dst)], [(theirs, src)])
            their_step, their_bytes, their_meta = theirs.tolist()
            sends, recvs = [], []
            if nbytes >= 0:
                sends = [(image, dst), (_blob(data), dst)]
                sent += nbytes + len(data)
            stored = False
            if their_bytes >= 0:
                base = self.store.base("replica", their_step, src)
                buffer, stored = self._landing(base, their_bytes, errors)
                meta_in = torch.empty(their_meta, dtype=torch.uint8)
                recvs = [(buffer, src), (meta_in, src)]
            self._exchange(sends, recvs)
            if stored:
                self.store.publish(base, {"kind": "replica", "source": src, "step": their_step,
                                          "nbytes": their_bytes,
                                          "meta": json.loads(bytes(meta_in.numpy()))})
        if errors:
            raise RuntimeError(f"cannot hold a peer's snapshot of step {step}: {errors[0]}")
        return sent

    def _erasure(self, step: int, image: Optional[torch.Tensor], data: bytes) -> int:
        d = self.spec.ec_data
        stripe = rd.stripe_of(self.rank, self.topo, d)
        pos = stripe.index(self.rank)
        others = [r for r in stripe if r != self.rank]
        nbytes = image.numel() if image is not None else -1
        # Headers and metadata to every position: any of them may have to hand a lost
        # peer its metadata at recovery.
        header = torch.tensor([step, nbytes, len(data)], dtype=torch.int64)
        headers = {r: torch.zeros(3, dtype=torch.int64) for r in others}
        self._exchange([(header, r) for r in others], [(headers[r], r) for r in others])
        info = {r: h.tolist() for r, h in headers.items()}
        info[self.rank] = [step, nbytes, len(data)]
        metas_in = {r: torch.empty(info[r][2], dtype=torch.uint8) for r in others}
        self._exchange([(_blob(data), r) for r in others], [(metas_in[r], r) for r in others])
        sent = len(data) * len(others)
        if any(s != step or n < 0 for s, n, _ in info.values()):
            return sent  # a member has no snapshot of this step: no parity for it
        chunk = rd.chunk_size([n for _, n, _ in info.values()], d)
        base = self.store.base("parity", step)
        errors: List[str] = []
        parity, stored = self._landing(base, chunk, errors)
        scratch = torch.empty(chunk, dtype=torch.uint8) if d > 1 else None
        group = d + 1
        for k in range(1, d + 1):
            dst, src = stripe[(pos - k) % group], stripe[(pos + k) % group]
            piece = rd.padded_chunk(image, chunk, k - 1)
            into = parity if k == 1 else scratch
            self._exchange([(piece, dst)], [(into, src)])
            if k > 1:
                rd.xor_into(parity, scratch)
            sent += chunk
        if not stored:
            raise RuntimeError(f"cannot hold the parity of step {step}: {errors[0]}")
        metas = {str(self.rank): json.loads(data)}
        metas.update({str(r): json.loads(bytes(metas_in[r].numpy())) for r in others})
        self.store.publish(base, {"kind": "parity", "step": step, "nbytes": chunk,
                                  "stripe": stripe, "metas": metas})
        return sent

    # -- recovery (main thread, every rank) ---------------------------------------------

    def holdings_record(self) -> Tuple[Dict[int, List[int]], Dict[int, int]]:
        """What this rank holds for its peers, for the recovery's ``all_gather``."""
        replicas, parities = self.store.holdings()
        return {src: sorted(steps) for src, steps in replicas.items()}, parities

    def rebuild(self, plan: rd.RebuildPlan, parity_chunks: Dict[int, Dict[int, int]],
                own_image, slots) -> Dict[str, Any]:
        """Run ``plan``'s transfers (every rank, the same plan): send what this rank holds,
        receive and assemble what it lacks, and publish it as its own snapshot slot.

        Args:
            parity_chunks: holder rank -> {step: chunk bytes} (from the gathered holdings).
            own_image: ``step -> uint8 tensor`` of this rank's own snapshot image.
            slots: this rank's :class:`deepspeed_ext.snapshot.SnapshotSlots`.

        Returns:
            ``{"received": bytes, "sent": bytes}`` of this rank.
        """
        meta: Optional[Dict[str, Any]] = None
        buffer: Optional[torch.Tensor] = None
        slot = None
        parts: Dict[int, torch.Tensor] = {}
        received = sent = 0
        errors: List[str] = []
        # An error on one side must not strand the other in a send or receive: every
        # transfer is still met (a failed sender sends a "nothing" mark, a failed
        # receiver goes on receiving), and the errors are raised at the end.
        for t in plan.transfers:
            if t.src == self.rank:
                sent += self._send_piece(t, parity_chunks, own_image, errors)
            elif t.dst == self.rank:
                data = self._recv_blob(t.src)
                if data is None:
                    errors.append(f"rank {t.src} could not send its {t.kind} of step {t.step}")
                    continue
                received += data.numel()
                if errors:
                    continue
                try:
                    if t.kind == "meta":
                        meta = json.loads(bytes(data.numpy()))
                        slot = slots.choose()
                        slots.invalidate(slot)
                        buffer = slots.buffer(slot, image_end(meta))
                    elif t.kind == "replica":
                        buffer.copy_(data)
                    elif t.kind == "parity":
                        parts[t.part] = data  # a fresh tensor: XOR-ed into in place
                    else:
                        rd.xor_into(parts[t.part], data)
                except Exception as e:
                    errors.append(f"{t.kind} from rank {t.src}: {type(e).__name__}: {e}")
        if errors:
            raise RuntimeError("; ".join(errors))
        if meta is not None:
            size = buffer.numel()
            for m, acc in parts.items():
                start, stop = rd.chunk_span(size, acc.numel(), m)
                buffer[start:stop] = acc[:stop - start]
            slots.publish(slot, meta)
        return {"received": received, "sent": sent}

    def _send_piece(self, t: rd.Transfer, parity_chunks, own_image, errors: List[str]) -> int:
        try:
            data = self._piece(t, parity_chunks, own_image)
        except Exception as e:
            errors.append(f"reading its {t.kind} of step {t.step} for rank {t.dst}: "
                          f"{type(e).__name__}: {e}")
            dist.send(torch.tensor([-1], dtype=torch.int64), t.dst, group=self.group)
            return 0
        self._send_blob(data, t.dst)
        return data.numel()

    def _piece(self, t: rd.Transfer, parity_chunks, own_image) -> torch.Tensor:
        if t.kind == "meta" and t.source >= 0:
            data = _blob(json.dumps(self.store.record(self.store.base("replica", t.step,
                                                                     t.source))["meta"]).encode())
        elif t.kind == "meta":
            record = self.store.record(self.store.base("parity", t.step))
            data = _blob(json.dumps(record["metas"][str(t.dst)]).encode())
        elif t.kind == "replica":
            base = self.store.base("replica", t.step, t.source)
            data = self.store.read(base, self.store.record(base)["nbytes"])
        elif t.kind == "parity":
            base = self.store.base("parity", t.step)
            data = self.store.read(base, self.store.record(base)["nbytes"])
        else:
            stripe = rd.stripe_of(t.dst, self.topo, self.spec.ec_data)
            holder = stripe[rd.parity_holder(stripe.index(t.dst), t.part, self.spec.ec_data)]
            chunk = parity_chunks[holder][t.step]
            data = rd.padded_chunk(own_image(t.step), chunk, t.chunk)
        return data

    def _send_blob(self, data: torch.Tensor, dst: int) -> None:
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=self.group)
        if data.numel():
            dist.send(data.contiguous(), dst, group=self.group)

    def _recv_blob(self, src: int) -> Optional[torch.Tensor]:
        """The next blob from ``src``; None when it sent the "nothing" mark."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group)
        if size.item() < 0:
            return None
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            dist.recv(data, src, group=self.group)
        return data

    def close(self) -> None:
        """Wait for the queued protections and stop the thread (every rank, at shutdown)."""
        try:
            self.wait_slots()
        finally:
            self.pool.shutdown(wait=True)

    def stop(self) -> None:
        """This rank alone, after its run failed: the protection thread stops once its
        current protection ends, without waiting for the queued ones (they would run
        collectives with peers that may be gone)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def summary(self) -> str:
        with self._lock:
            done = list(self.protected)
        if not done:
            return f"redundancy ({self.spec.describe()}): no snapshot protected"
        seconds = sorted(s for _, _, s in done)
        return (f"redundancy ({self.spec.describe()}): {len(done)} snapshot(s) protected, "
                f"{sum(b for _, b, _ in done) / 2**20:.1f} MiB sent by this rank, "
                f"median {seconds[len(seconds) // 2]:.3f} s per snapshot; "
                f"{self.store.host_bytes() / 2**20:.1f} MiB held for peers")
