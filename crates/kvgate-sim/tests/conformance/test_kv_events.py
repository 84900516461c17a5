"""Conformance of `kvgate sim`'s KV events with vLLM's wire format.

vLLM's event structs are transcribed from the reference spec (vllm-kv-protocol.md §1.4-1.5,
vLLM 0.33 map form and the <= 0.23 array form) and every live batch is decoded with msgspec
in strict mode (unknown fields forbidden). Checks: 3-frame messages, consecutive sequence
numbers, BlockStored/BlockRemoved invariants, and that replay returns the live batches
byte-for-byte followed by the end marker.

Environment (set by scripts/ci_sim_conformance.sh):
  SIM_HTTP      http://127.0.0.1:PORT
  SIM_EVENTS    tcp://127.0.0.1:PORT   (PUB)
  SIM_REPLAY    tcp://127.0.0.1:PORT   (ROUTER)
  SIM_ENCODING  map | array

Runs under pytest or standalone (`python test_kv_events.py`, prints "N passed, N failed").
"""

from __future__ import annotations

import json
from collections import Counter
import os
import sys
import time
import urllib.request
from typing import Any, Optional, Union

import msgspec
import zmq

HTTP = os.environ.get("SIM_HTTP", "http://127.0.0.1:8000")
EVENTS = os.environ.get("SIM_EVENTS", "tcp://127.0.0.1:5557")
REPLAY = os.environ.get("SIM_REPLAY", "tcp://127.0.0.1:5558")
ENCODING = os.environ.get("SIM_ENCODING", "map")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
U64 = 2**64

# --- vLLM 0.33 structs, map form (vLLM >= 0.24) ---------------------------------------


class MapEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    pass


class BlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[list[Any]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[list[int]]] = None


class BlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


# --- vLLM <= 0.23 structs, positional array form ----------------------------------------


class ArrEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class ArrBlockStored(ArrEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[list[Any]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class ArrBlockRemoved(ArrEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class ArrAllBlocksCleared(ArrEvent, tag="AllBlocksCleared"):
    pass


class ArrBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[ArrBlockStored, ArrBlockRemoved, ArrAllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


DECODER = msgspec.msgpack.Decoder(MapBatch if ENCODING == "map" else ArrBatch, strict=True)


def post(path: str, body: dict) -> dict:
    req = urllib.request.Request(
        HTTP + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def chat(content: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24}
    body.update(extra)
    return post("/v1/chat/completions", body)


def recv_all(sub: zmq.Socket, quiet_ms: int = 500) -> list[tuple[int, bytes, bytes]]:
    out = []
    while sub.poll(quiet_ms):
        frames = sub.recv_multipart()
        assert len(frames) == 3, f"expected 3 frames, got {len(frames)}"
        topic, seq, payload = frames
        assert len(seq) == 8
        out.append((int.from_bytes(seq, "big"), topic, payload))
    return out


def subscribe() -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(EVENTS)
    # Slow joiner: send distinct warm-up requests until the first batch arrives (32 tokens: a
    # full block at the sim's default block size).
    for i in range(100):
        post("/v1/completions", {"prompt": list(range(60000 + 32 * i, 60032 + 32 * i)), "max_tokens": 1})
        if sub.poll(200):
            recv_all(sub, 200)
            return ctx, sub
    raise AssertionError("no kv events received")


def check_batch(batch, seen_hashes: Counter) -> None:
    """`seen_hashes` counts cached copies per hash: vLLM caches a block whose content another
    block already has (e.g. identical decode output) under the same hash, announcing and
    removing each copy separately."""
    assert isinstance(batch.ts, float) and batch.ts > 1e9
    assert batch.data_parallel_rank == 0
    assert batch.events, "no empty batches"
    for ev in batch.events:
        name = type(ev).__name__.removeprefix("Arr")
        if name == "BlockStored":
            assert ev.medium == "GPU"
            assert all(isinstance(h, int) and 0 <= h < U64 for h in ev.block_hashes)
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            assert ev.extra_keys is not None and len(ev.extra_keys) == len(ev.block_hashes)
            assert ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention"
            if ev.parent_block_hash is not None:
                assert seen_hashes[ev.parent_block_hash] > 0, "parent announced earlier"
            seen_hashes.update(ev.block_hashes)
        elif name == "BlockRemoved":
            assert len(ev.block_hashes) == 1, "one BlockRemoved per evicted hash"
            assert ev.medium == "GPU"
            assert seen_hashes[ev.block_hashes[0]] > 0, "only announced blocks are removed"
            seen_hashes[ev.block_hashes[0]] -= 1
        else:
            seen_hashes.clear()


def test_live_stream_and_replay() -> None:
    ctx, sub = subscribe()
    try:
        assert post("/reset_prefix_cache", {})["success"] is True
        system = "You are a careful assistant. " * 30
        first = chat(system + "Question one?")
        second = chat(system + "Question one?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        chat(system + "Question two?", cache_salt="tenant-a")
        for i in range(12):  # enough distinct long prompts to force evictions
            chat(f"{i} " + "filler text to fill the cache " * 40)
        live = recv_all(sub)
        assert live, "received live batches"
        seqs = [s for s, _, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap in {seqs}"
        seen: Counter = Counter()
        kinds: set = set()
        for _, topic, payload in live:
            batch = DECODER.decode(payload)
            check_batch(batch, seen)
            kinds.update(type(e).__name__.removeprefix("Arr") for e in batch.events)
        assert {"AllBlocksCleared", "BlockStored", "BlockRemoved"} <= kinds, kinds

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(REPLAY)
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "replay timed out"
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames[:1]
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), topic, payload))
        assert replayed == live, "replayed batches equal the live ones"
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()


def test_replay_from_the_future_is_just_the_end_marker() -> None:
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(REPLAY)
        dealer.send_multipart([b"", (2**62).to_bytes(8, "big")])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
        dealer.close(0)
    finally:
        ctx.term()


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_") and callable(v)]
    passed = failed = 0
    for t in tests:
        start = time.time()
        try:
            t()
            passed += 1
            print(f"PASS {t.__name__} ({time.time() - start:.1f}s)")
        except Exception as e:  # noqa: BLE001 - report every failure
            failed += 1
            print(f"FAIL {t.__name__}: {type(e).__name__}: {e}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
