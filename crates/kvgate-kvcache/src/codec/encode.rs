//! [`KvEventBatch`](crate::KvEventBatch) → msgpack bytes identical to what msgspec produces in vLLM.
//!
//! msgspec rules reproduced here: ints in the smallest width (unsigned formats for values ≥ 0),
//! `str8` from 32 bytes, floats as `float64`; array-like structs carry every field; map-form
//! structs omit optional fields whose value is `None` but always carry fields without a
//! default. The map header width is fixed by the number of *declared* fields: `BlockStored`
//! declares 16 in 0.33 and so always gets a `map16` header (`de 00 0b` in the golden bytes).

use std::convert::Infallible;

use rmp::Marker;
use rmp::encode::{self as mp, ByteBuf, ValueWriteError};

use crate::event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent};

/// Event encoding on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Tagged maps `{"type": "BlockStored", …}` (vLLM ≥ 0.24).
    Map,
    /// Positional arrays `["BlockStored", …]` with the 12-field `BlockStored` (vLLM ≤ 0.23).
    Array,
}

/// Encodes a batch `[ts, events, data_parallel_rank]` (always the 3-element array form).
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<i64>,
    encoding: Encoding,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 96);
    encode_batch_into(&mut out, ts, events, data_parallel_rank, encoding);
    out
}

/// Like [`encode_batch`], appending to `out` (lets a publisher reuse one buffer).
pub fn encode_batch_into(
    out: &mut Vec<u8>,
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<i64>,
    encoding: Encoding,
) {
    let w = &mut Writer(ByteBuf::from_vec(std::mem::take(out)));
    w.array_len(3);
    w.f64(ts);
    w.array_len(events.len());
    for e in events {
        match (e, encoding) {
            (KvEvent::BlockStored(s), Encoding::Map) => stored_map(w, s),
            (KvEvent::BlockStored(s), Encoding::Array) => stored_array(w, s),
            (KvEvent::BlockRemoved(r), Encoding::Map) => removed_map(w, r),
            (KvEvent::BlockRemoved(r), Encoding::Array) => removed_array(w, r),
            (KvEvent::AllBlocksCleared, Encoding::Map) => {
                w.map_len(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (KvEvent::AllBlocksCleared, Encoding::Array) => {
                w.array_len(1);
                w.str("AllBlocksCleared");
            }
        }
    }
    w.opt(data_parallel_rank.as_ref(), |w, r| w.int(*r));
    *out = std::mem::take(&mut w.0).into_vec();
}

/// A msgpack length: rmp takes `u32`, the widest length msgpack has.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn stored_map(w: &mut Writer, s: &BlockStored) {
    let optional = [
        s.extra_keys.is_some(),
        s.group_idx.is_some(),
        s.kv_cache_spec_kind.is_some(),
        s.kv_cache_spec_sliding_window.is_some(),
        s.locality.is_some(),
        s.ownership.is_some(),
        s.session_id.is_some(),
        s.lookahead_token_ids.is_some(),
    ];
    let n = 8 + optional.iter().filter(|b| **b).count();
    w.map16(n as u16);
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    w.hashes(&s.block_hashes);
    w.str("parent_block_hash");
    w.opt(s.parent_block_hash.as_ref(), Writer::hash);
    w.str("token_ids");
    w.tokens(&s.token_ids);
    w.str("block_size");
    w.uint(u64::from(s.block_size));
    w.str("lora_id");
    w.opt(s.lora_id.as_ref(), |w, v| w.int(*v));
    w.str("medium");
    w.opt(s.medium.as_deref(), Writer::str);
    w.str("lora_name");
    w.opt(s.lora_name.as_deref(), Writer::str);
    if let Some(x) = &s.extra_keys {
        w.str("extra_keys");
        w.extra_keys(x);
    }
    if let Some(g) = s.group_idx {
        w.str("group_idx");
        w.int(g);
    }
    if let Some(k) = &s.kv_cache_spec_kind {
        w.str("kv_cache_spec_kind");
        w.str(k);
    }
    if let Some(sw) = s.kv_cache_spec_sliding_window {
        w.str("kv_cache_spec_sliding_window");
        w.int(sw);
    }
    for (name, val) in [
        ("locality", &s.locality),
        ("ownership", &s.ownership),
        ("session_id", &s.session_id),
    ] {
        if let Some(v) = val {
            w.str(name);
            w.str(v);
        }
    }
    if let Some(l) = &s.lookahead_token_ids {
        w.str("lookahead_token_ids");
        w.array_len(l.len());
        for t in l {
            w.tokens(t);
        }
    }
}

fn stored_array(w: &mut Writer, s: &BlockStored) {
    w.array_len(12);
    w.str("BlockStored");
    w.hashes(&s.block_hashes);
    w.opt(s.parent_block_hash.as_ref(), Writer::hash);
    w.tokens(&s.token_ids);
    w.uint(u64::from(s.block_size));
    w.opt(s.lora_id.as_ref(), |w, v| w.int(*v));
    w.opt(s.medium.as_deref(), Writer::str);
    w.opt(s.lora_name.as_deref(), Writer::str);
    w.opt(s.extra_keys.as_ref(), |w, x| w.extra_keys(x));
    w.opt(s.group_idx.as_ref(), |w, v| w.int(*v));
    w.opt(s.kv_cache_spec_kind.as_deref(), Writer::str);
    w.opt(s.kv_cache_spec_sliding_window.as_ref(), |w, v| w.int(*v));
}

fn removed_map(w: &mut Writer, r: &BlockRemoved) {
    let n = 3 + [
        r.group_idx.is_some(),
        r.locality.is_some(),
        r.ownership.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    w.map_len(n);
    w.str("type");
    w.str("BlockRemoved");
    w.str("block_hashes");
    w.hashes(&r.block_hashes);
    w.str("medium");
    w.opt(r.medium.as_deref(), Writer::str);
    if let Some(g) = r.group_idx {
        w.str("group_idx");
        w.int(g);
    }
    for (name, val) in [("locality", &r.locality), ("ownership", &r.ownership)] {
        if let Some(v) = val {
            w.str(name);
            w.str(v);
        }
    }
}

fn removed_array(w: &mut Writer, r: &BlockRemoved) {
    w.array_len(4);
    w.str("BlockRemoved");
    w.hashes(&r.block_hashes);
    w.opt(r.medium.as_deref(), Writer::str);
    w.opt(r.group_idx.as_ref(), |w, v| w.int(*v));
}

/// A msgpack writer with msgspec's format choices, over `rmp::encode` (whose writers already
/// pick the smallest width, as msgspec does).
struct Writer(ByteBuf);

/// Writing into a [`ByteBuf`] cannot fail: its error type is uninhabited.
fn infallible<T>(written: Result<T, ValueWriteError<Infallible>>) {
    let Ok(_) = written;
}

/// Same for the writers whose error is the buffer's own.
fn infallible_marker(written: Result<(), Infallible>) {
    let Ok(()) = written;
}

impl Writer {
    fn nil(&mut self) {
        infallible_marker(mp::write_nil(&mut self.0));
    }

    fn opt<T: ?Sized>(&mut self, v: Option<&T>, f: impl FnOnce(&mut Self, &T)) {
        match v {
            Some(v) => f(self, v),
            None => self.nil(),
        }
    }

    fn f64(&mut self, v: f64) {
        infallible(mp::write_f64(&mut self.0, v));
    }

    fn uint(&mut self, v: u64) {
        infallible(mp::write_uint(&mut self.0, v));
    }

    fn int(&mut self, v: i64) {
        infallible(mp::write_sint(&mut self.0, v));
    }

    fn str(&mut self, s: &str) {
        infallible(mp::write_str(&mut self.0, s));
    }

    fn bin(&mut self, b: &[u8]) {
        infallible(mp::write_bin(&mut self.0, b));
    }

    fn array_len(&mut self, n: usize) {
        infallible(mp::write_array_len(&mut self.0, len32(n)));
    }

    fn map_len(&mut self, n: usize) {
        infallible(mp::write_map_len(&mut self.0, len32(n)));
    }

    /// A `map16` header whatever `n` is (rmp would pick `fixmap` below 16).
    fn map16(&mut self, n: u16) {
        let out = self.0.as_mut_vec();
        out.push(Marker::Map16.to_u8());
        out.extend_from_slice(&n.to_be_bytes());
    }

    fn hash(&mut self, h: &BlockHash) {
        match h {
            BlockHash::Int(v) => self.uint(*v),
            BlockHash::Bytes(b) => self.bin(b),
        }
    }

    fn hashes(&mut self, hs: &[BlockHash]) {
        self.array_len(hs.len());
        for h in hs {
            self.hash(h);
        }
    }

    fn tokens(&mut self, ts: &[u32]) {
        self.array_len(ts.len());
        for t in ts {
            self.uint(u64::from(*t));
        }
    }

    fn extra_keys(&mut self, x: &[Option<Vec<ExtraKey>>]) {
        self.array_len(x.len());
        for entry in x {
            self.opt(entry.as_deref(), |w, items| {
                w.array_len(items.len());
                for item in items {
                    match item {
                        ExtraKey::Str(s) | ExtraKey::Other(s) => w.str(s),
                        ExtraKey::Mm { identifier, offset } => {
                            w.array_len(2);
                            w.str(identifier);
                            w.int(*offset);
                        }
                        ExtraKey::Bytes(b) => w.bin(b),
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// msgspec's format choice at each width boundary (checked against msgspec 0.19).
    #[test]
    fn writer_widths_at_every_boundary() {
        type Write = Box<dyn Fn(&mut Writer)>;
        let s = |n: usize| -> Write { Box::new(move |w| w.str(&"s".repeat(n))) };
        let cases: Vec<(&str, Write, String)> = vec![
            ("nil", Box::new(|w| w.nil()), "c0".into()),
            ("f64", Box::new(|w| w.f64(1.5)), "cb3ff8000000000000".into()),
            ("uint 0", Box::new(|w| w.uint(0)), "00".into()),
            ("uint 127", Box::new(|w| w.uint(127)), "7f".into()),
            ("uint 128", Box::new(|w| w.uint(128)), "cc80".into()),
            ("uint 255", Box::new(|w| w.uint(255)), "ccff".into()),
            ("uint 256", Box::new(|w| w.uint(256)), "cd0100".into()),
            ("uint 65535", Box::new(|w| w.uint(65535)), "cdffff".into()),
            (
                "uint 65536",
                Box::new(|w| w.uint(65536)),
                "ce00010000".into(),
            ),
            (
                "uint u32 max",
                Box::new(|w| w.uint(u64::from(u32::MAX))),
                "ceffffffff".into(),
            ),
            (
                "uint 2^32",
                Box::new(|w| w.uint(1 << 32)),
                "cf0000000100000000".into(),
            ),
            ("int 5", Box::new(|w| w.int(5)), "05".into()),
            ("int 200", Box::new(|w| w.int(200)), "ccc8".into()),
            (
                "int i64 max",
                Box::new(|w| w.int(i64::MAX)),
                "cf7fffffffffffffff".into(),
            ),
            ("int -1", Box::new(|w| w.int(-1)), "ff".into()),
            ("int -32", Box::new(|w| w.int(-32)), "e0".into()),
            ("int -33", Box::new(|w| w.int(-33)), "d0df".into()),
            ("int -128", Box::new(|w| w.int(-128)), "d080".into()),
            ("int -129", Box::new(|w| w.int(-129)), "d1ff7f".into()),
            ("int -32768", Box::new(|w| w.int(-32768)), "d18000".into()),
            (
                "int -32769",
                Box::new(|w| w.int(-32769)),
                "d2ffff7fff".into(),
            ),
            (
                "int i32 min",
                Box::new(|w| w.int(i64::from(i32::MIN))),
                "d280000000".into(),
            ),
            (
                "int below i32",
                Box::new(|w| w.int(i64::from(i32::MIN) - 1)),
                "d3ffffffff7fffffff".into(),
            ),
            ("str 0", s(0), "a0".into()),
            ("str 31", s(31), format!("bf{}", "73".repeat(31))),
            ("str 32", s(32), format!("d920{}", "73".repeat(32))),
            ("str 255", s(255), format!("d9ff{}", "73".repeat(255))),
            ("str 256", s(256), format!("da0100{}", "73".repeat(256))),
            ("bin 0", Box::new(|w| w.bin(&[])), "c400".into()),
            (
                "bin 255",
                Box::new(|w| w.bin(&[1; 255])),
                format!("c4ff{}", "01".repeat(255)),
            ),
            (
                "bin 256",
                Box::new(|w| w.bin(&[1; 256])),
                format!("c50100{}", "01".repeat(256)),
            ),
            (
                "bin 65536",
                Box::new(|w| w.bin(&[1; 65536])),
                format!("c600010000{}", "01".repeat(65536)),
            ),
            ("array 15", Box::new(|w| w.array_len(15)), "9f".into()),
            ("array 16", Box::new(|w| w.array_len(16)), "dc0010".into()),
            (
                "array 65536",
                Box::new(|w| w.array_len(65536)),
                "dd00010000".into(),
            ),
            ("map 15", Box::new(|w| w.map_len(15)), "8f".into()),
            ("map 16", Box::new(|w| w.map_len(16)), "de0010".into()),
            (
                "map 65536",
                Box::new(|w| w.map_len(65536)),
                "df00010000".into(),
            ),
            ("map16 of 3", Box::new(|w| w.map16(3)), "de0003".into()),
        ];
        for (name, write, want) in cases {
            let mut w = Writer(ByteBuf::new());
            write(&mut w);
            let got: String = w.0.as_slice().iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(got, want, "{name}");
        }
    }
}
