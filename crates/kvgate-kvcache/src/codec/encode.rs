//! [`KvEventBatch`] → msgpack bytes identical to what msgspec produces in vLLM.
//!
//! msgspec rules reproduced here: ints in the smallest width (unsigned formats for values ≥ 0),
//! `str8` from 32 bytes, floats as `float64`; array-like structs carry every field; map-form
//! structs omit optional fields whose value is `None` but always carry fields without a
//! default. The map header width is fixed by the number of *declared* fields: `BlockStored`
//! declares 16 in 0.33 and so always gets a `map16` header (`de 00 0b` in the golden bytes).

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
    let w = &mut Writer(out);
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
}

fn stored_map(w: &mut Writer<'_>, s: &BlockStored) {
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

fn stored_array(w: &mut Writer<'_>, s: &BlockStored) {
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

fn removed_map(w: &mut Writer<'_>, r: &BlockRemoved) {
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

fn removed_array(w: &mut Writer<'_>, r: &BlockRemoved) {
    w.array_len(4);
    w.str("BlockRemoved");
    w.hashes(&r.block_hashes);
    w.opt(r.medium.as_deref(), Writer::str);
    w.opt(r.group_idx.as_ref(), |w, v| w.int(*v));
}

/// Minimal msgpack writer with msgspec's format choices.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn opt<T: ?Sized>(&mut self, v: Option<&T>, f: impl FnOnce(&mut Self, &T)) {
        match v {
            Some(v) => f(self, v),
            None => self.nil(),
        }
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u64::from(u16::MAX) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.0.push(v as u8);
        } else if v >= i64::from(i8::MIN) {
            self.0.extend_from_slice(&[0xd0, v as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn len_header(&mut self, n: usize, fix: u8, fix_max: usize, m8: Option<u8>, m16: u8, m32: u8) {
        if n < fix_max {
            self.0.push(fix | n as u8);
        } else if let (Some(m8), true) = (m8, n <= usize::from(u8::MAX)) {
            self.0.extend_from_slice(&[m8, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            self.0.push(m16);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(m32);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    fn str(&mut self, s: &str) {
        self.len_header(s.len(), 0xa0, 32, Some(0xd9), 0xda, 0xdb);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn bin(&mut self, b: &[u8]) {
        if b.len() <= usize::from(u8::MAX) {
            self.0.extend_from_slice(&[0xc4, b.len() as u8]);
        } else {
            self.len_header(b.len(), 0, 0, None, 0xc5, 0xc6);
        }
        self.0.extend_from_slice(b);
    }

    fn array_len(&mut self, n: usize) {
        self.len_header(n, 0x90, 16, None, 0xdc, 0xdd);
    }

    fn map_len(&mut self, n: usize) {
        self.len_header(n, 0x80, 16, None, 0xde, 0xdf);
    }

    fn map16(&mut self, n: u16) {
        self.0.push(0xde);
        self.0.extend_from_slice(&n.to_be_bytes());
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
