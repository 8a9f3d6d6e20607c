"""A rank other than 0: `python -m dsv4_engine.parallel.worker`, spawned by rank 0 (or, on the
other nodes of a multi-node engine, by that node's agent: dsv4_engine.parallel.node_agent).

It loads its shard of the weights, builds a KV pool that mirrors rank 0's, then runs each batch
rank 0 broadcasts until told to stop. It never recovers from an error: it exits non-zero, and
whoever spawned it takes the engine down (rank 0's watchdog, or the node agent, which tells
node 0). SIGUSR1 dumps every thread's stack into its stacks file (evidence of a stuck rank)."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from dsv4_engine.parallel import wire
from dsv4_engine.parallel.group import (
    agree_failure,
    all_ranks_agree,
    gather_descriptors,
    join,
    rank_device,
    tightest_memory,
)
from dsv4_engine.parallel.layout import NodeLayout
from dsv4_engine.parallel.plan import Shard
from dsv4_engine.parallel.ranks import HEARTBEAT_S, SPEC_ENV
from dsv4_wire import switches

log = logging.getLogger("dsv4.tp")

# What a speculating rank runs (parallel.spec.SpecRank): eager forwards, ring rollbacks, replays.
SPEC_OPS = (
    wire.OP_SPEC_TARGET,
    wire.OP_SPEC_MTP,
    wire.OP_RING_SAVE,
    wire.OP_RING_RESTORE,
    wire.OP_SPEC_VERIFY_GRAPH,
    wire.OP_SPEC_DRAFT_GRAPH,
    wire.OP_SPEC_CATCH_UP_GRAPH,
)


def _forget_files(spec: dict) -> None:
    """Rank 0 is gone and cannot remove this rank's heartbeat / reason files: this rank does."""
    for key in ("alive_file", "error_file"):
        try:
            os.unlink(spec[key])
        except (KeyError, OSError):
            pass


def _watch_parent(spec: dict) -> None:
    """Its parent (rank 0, or this node's agent) is gone (killed, crashed): nothing left to serve."""
    parent = spec["parent"]
    while True:
        if os.getppid() != parent:
            print(f"dsv4 tp rank: its parent (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
            _forget_files(spec)
            os._exit(1)
        time.sleep(0.25)


def _heartbeat(path: str) -> None:
    """Touch `path` every HEARTBEAT_S: rank 0 tells a slow load from a stopped rank by it. Made
    once, then only touched: a file rank 0 has removed (the group is done) stays removed."""
    try:
        with open(path, "a"):
            pass
    except OSError:
        return
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            os.utime(path)
        except OSError:
            return


def serve_rank(spec: dict) -> None:
    from dsv4_engine.kv_cache import KVPool, copy_snapshot
    from dsv4_engine.kv_sizing import device_memory
    from dsv4_engine.model_runner import ModelRunner

    shard = Shard(spec["rank"], spec["size"])
    ea = spec["engine"]
    local_rank, local_size = spec.get("local_rank", shard.rank), spec.get("local_size", shard.size)
    device = rank_device(ea.get("device"), local_rank)  # this host's GPU of its place on the host
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    layout = NodeLayout(
        ea.get("tp_size") or shard.size, ea.get("nnodes") or 1, ea.get("node_rank") or 0, ea.get("dist_init_addr")
    )
    rank = join(shard, spec.get("init") or spec["port"], device, layout)
    rank.data_parallel = (ea.get("dp_size") or 1) > 1  # its own requests' attention, the MoE over all
    runner = ModelRunner(
        ea["model"],
        ea.get("dtype"),
        device,
        ea.get("kernel_backend"),
        tp=rank,
        kv_cache_dtype=ea.get("kv_cache_dtype"),
        ep_redundant_experts=ea.get("ep_redundant_experts") or 0,
        ep_loads_file=ea.get("ep_loads_file"),
    )
    specs, speculator = runner.state_specs, None
    if ea.get("speculative_algorithm") is not None:  # as rank 0's Engine: its MTP shard and state
        from dsv4_engine.spec_decode.build import make_speculator

        speculator = make_speculator(runner, ea["model"], ea["speculative_num_steps"])
        if rank.data_parallel:  # its captured steps: its own requests' (parallel.dp_spec_graphs)
            from dsv4_engine.parallel.dp_spec_graphs import DPSpecGraphs

            speculator.graphs_class = DPSpecGraphs
        specs = specs + speculator.state_specs
    tightest_memory(device_memory(runner.device), rank)  # rank 0 sizes the pool on the tightest rank
    sizes = torch.zeros(4, dtype=torch.int64)
    dist.broadcast(sizes, 0, group=rank.control)
    num_pages, page_size, max_num_seqs, num_snapshots = sizes.tolist()
    pool = KVPool(specs, num_pages, page_size, runner.dtype, runner.device, max_num_seqs)
    spec_rank = None
    if speculator is not None:
        from dsv4_engine.parallel.spec import SpecRank

        spec_rank = SpecRank(speculator, pool, rank)
    # The prefix cache's snapshots of slot rows (V4): rank 0 keeps the books, this rank the copies.
    # (--dp-size N: its own requests' only; rank r's are the engine's ids r*n.. (r+1)*n-1, as are
    # its slot rows among the engine's: parallel.dp_pages.DPSlotAllocator.)
    snapshots = (
        {
            name: torch.zeros(num_snapshots, *t.shape[1:], dtype=t.dtype, device=t.device)
            for name, t in pool.slot_states.items()
        }
        if num_snapshots
        else {}
    )
    header = torch.zeros(wire.HEADER_LEN, dtype=torch.int64)
    relay = None  # PD: this rank's own KV transport (a decode's relay to rank 0, a DP prefill's sender)
    while True:
        dist.broadcast(header, 0, group=rank.control)
        op = int(header[wire.OP])
        if op == wire.OP_STOP:
            if relay is not None:
                relay.close()
            return
        if op == wire.OP_CAPTURE:  # at start-up, with every other rank: all keep graphs or none
            agree = lambda f: agree_failure(f, rank)  # noqa: E731
            if spec_rank is not None:  # a speculating group captures the speculator's steps instead
                if not all_ranks_agree(spec_rank.capture(int(header[wire.REQS]), agree), rank):
                    spec_rank.graphs = None
                continue
            runner.enable_graphs(int(header[wire.REQS]))
            if rank.data_parallel and runner.cuda_graph_max_bs:  # its own requests' steps (parallel.dp_graphs)
                from dsv4_engine.parallel.dp_graphs import dp_decode_graphs

                runner.graphs = dp_decode_graphs(runner, pool)
            if not all_ranks_agree(runner.capture_graphs(pool, agree), rank):
                runner.drop_graphs()
            continue
        if op == wire.OP_PD_POOLS:  # PD: this rank's pool behind its own KV transport
            if ea.get("role") == "prefill":  # --dp-size N: it writes its requests' pages (pd.dp_sender)
                from dsv4_engine.pd.dp_sender import RankSender as Agent
            else:  # decode: it receives its share (TP) or its requests (DP) from prefill itself
                from dsv4_engine.pd.rank_pools import RankRelay as Agent

            relay = Agent.start(pool, shard.rank, lambda desc: gather_descriptors(desc, rank))
            continue
        payload = torch.empty(wire.payload_len(header), dtype=torch.int64)
        dist.broadcast(payload, 0, group=rank.control)
        if op == wire.OP_FORWARD:
            runner.model.forward(wire.unpack(header, payload, runner.device), pool.all_states)
        elif op == wire.OP_DP_FORWARD:
            from dsv4_engine.parallel.dp_attention import serve_share

            serve_share(runner.model, header, payload, pool.all_states)
        elif op == wire.OP_DP_GRAPH:
            from dsv4_engine.parallel.dp_graphs import serve_graph_share

            serve_graph_share(runner.graphs, header, payload)
        elif op in (wire.OP_DP_SPEC_VERIFY_GRAPH, wire.OP_DP_SPEC_DRAFT_GRAPH):
            from dsv4_engine.parallel.dp_spec_graphs import serve_spec_graph

            if spec_rank is None or spec_rank.graphs is None:
                raise RuntimeError("rank 0 replayed a speculative graph this rank did not capture")
            serve_spec_graph(spec_rank.graphs, op, header, payload, rank)
        elif op in (wire.OP_DP_SPEC_TARGET, wire.OP_DP_SPEC_MTP):
            from dsv4_engine.parallel.dp_spec import serve_spec_share

            if speculator is None:
                raise RuntimeError("rank 0 sent a speculative step, but this rank runs without speculation")
            serve_spec_share(op, speculator, header, payload, pool.all_states, rank)
        elif op in SPEC_OPS:
            if spec_rank is None:
                raise RuntimeError("rank 0 sent a speculative step, but this rank runs without speculation")
            spec_rank.handle(op, header, payload)
        elif op == wire.OP_GRAPH:
            runner._states = pool.all_states
            runner.graphs.step(wire.unpack_host(header, payload))
        elif op == wire.OP_EPLB:  # a rebalance between steps: this rank's new experts (parallel.eplb_apply)
            from dsv4_engine.parallel.eplb_apply import unpack_placement

            runner.eplb.apply(unpack_placement(payload))
        elif op == wire.OP_SNAPSHOT:
            if not snapshots:
                raise RuntimeError("rank 0 copied a prefix-cache snapshot, but announced none")
            kind, snap, row = wire.unpack_snapshot(payload)
            if rank.data_parallel:  # another rank's request: that rank copies it
                from dsv4_engine.parallel.dp_cache import own_snapshot_row

                snap = own_snapshot_row(snap, shard.rank, num_snapshots)
                row -= shard.rank * pool.num_slots  # the request's row among this rank's own
            if snap is not None:
                copy_snapshot(snapshots, pool.slot_states, kind, snap, row)
        else:
            raise RuntimeError(f"unknown operation {op} from rank 0")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(switches.read(SPEC_ENV))
    if spec.get("stacks_file"):  # before the heartbeat: whoever sees a beat may ask for stacks
        faulthandler.register(signal.SIGUSR1, file=open(spec["stacks_file"], "a"), all_threads=True)
    threading.Thread(target=_watch_parent, args=(spec,), daemon=True).start()
    if spec.get("alive_file"):
        threading.Thread(target=_heartbeat, args=(spec["alive_file"],), daemon=True).start()
    try:
        serve_rank(spec)
    except BaseException as e:
        print(f"dsv4 tp rank {spec['rank']} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if os.getppid() != spec["parent"]:  # rank 0 is gone: nobody to tell
            _forget_files(spec)
        elif spec.get("error_file"):  # rank 0 names this line in its own failure
            try:
                # Whole or not at all: rank 0 may read it the moment this process is gone.
                tmp = spec["error_file"] + ".tmp"
                with open(tmp, "w") as f:
                    f.write(f"{type(e).__name__}: {e}".splitlines()[0][:2000])
                os.replace(tmp, spec["error_file"])
            except OSError:
                pass
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
