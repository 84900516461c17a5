//! Streaming fast path for [`decode_batch`](super::decode_batch).
//!
//! Walks the msgpack bytes once, decoding the hot arrays (`token_ids`, `block_hashes`, all-nil
//! `extra_keys`) straight into vectors and every other value through rmpv's borrowed
//! [`ValueRef`](rmpv::ValueRef) with the exact depth budget the full-tree decode would give it.
//! Anything unusual (invalid msgpack, a malformed event, a non-batch, a map event whose `type`
//! is not its first key, …) returns `None` and the caller falls back to the full-tree decoder,
//! so a `Some` result is always identical to what that decoder returns.

use super::{
    DecodeStats, R, REMOVED_FIELDS, REMOVED_MAP_ONLY, STORED_FIELDS, STORED_MAP_ONLY, Value,
    set_removed, set_stored, vstr,
};
use crate::event::{BlockHash, BlockRemoved, BlockStored, KvEvent, KvEventBatch};

/// rmpv depth budget left for an element of the batch array / a value of the batch map.
const ENVELOPE_DEPTH: usize = 14;
/// rmpv depth budget left for an element of an event array / a key or value of an event map.
const FIELD_DEPTH: usize = 10;

type Rd<'a> = &'a [u8];

/// Decodes `payload` if it has a common shape; `None` means "use the full-tree decoder".
pub(super) fn decode_batch_fast(payload: &[u8]) -> Option<(KvEventBatch, DecodeStats)> {
    let mut rd: Rd<'_> = payload;
    let mut stats = DecodeStats::default();
    let marker = byte(&mut rd)?;
    let (ts, events, rank) = if let Some(len) = array_len(marker, &mut rd)? {
        if !(2..=3).contains(&len) {
            return None;
        }
        let ts = generic(&mut rd, ENVELOPE_DEPTH)?;
        let events = events(&mut rd, &mut stats)?;
        let rank = if len == 3 {
            generic(&mut rd, ENVELOPE_DEPTH)?
        } else {
            Value::Nil
        };
        (ts, events, rank)
    } else if let Some(len) = map_len(marker, &mut rd)? {
        let (mut ts, mut events, mut rank) = (Value::Nil, None, Value::Nil);
        for _ in 0..len {
            let k = generic(&mut rd, ENVELOPE_DEPTH)?;
            match vstr(&k) {
                Some("ts") => ts = generic(&mut rd, ENVELOPE_DEPTH)?,
                Some("events") => {
                    if events.is_some() {
                        return None;
                    }
                    events = Some(self::events(&mut rd, &mut stats)?);
                }
                Some("data_parallel_rank") => rank = generic(&mut rd, ENVELOPE_DEPTH)?,
                _ => {
                    generic(&mut rd, ENVELOPE_DEPTH)?;
                    stats.unknown_fields += 1;
                }
            }
        }
        (ts, events?, rank)
    } else {
        return None;
    };
    if !rd.is_empty() {
        return None;
    }
    let ts = match ts {
        Value::Nil => 0.0,
        Value::F64(f) => f,
        Value::F32(f) => f64::from(f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        _ => return None,
    };
    let data_parallel_rank = match rank {
        Value::Nil => None,
        Value::Integer(i) => i.as_i64(),
        _ => return None,
    };
    Some((
        KvEventBatch {
            ts,
            events,
            data_parallel_rank,
        },
        stats,
    ))
}

/// The `events` array; `None` on anything the fast path does not handle.
fn events(rd: &mut Rd<'_>, stats: &mut DecodeStats) -> Option<Vec<KvEvent>> {
    let marker = byte(rd)?;
    let len = array_len(marker, rd)??;
    // Every event takes at least one byte, so this bounds the allocation by the payload.
    let mut out = Vec::with_capacity(len.min(rd.len()));
    for _ in 0..len {
        match event(rd, stats)? {
            Some(e) => out.push(e),
            None => stats.unknown_events += 1,
        }
    }
    Some(out)
}

/// One event: `Some(None)` for an unknown tag (skipped, still validated), `None` to bail out.
fn event(rd: &mut Rd<'_>, stats: &mut DecodeStats) -> Option<Option<KvEvent>> {
    let marker = byte(rd)?;
    if let Some(len) = array_len(marker, rd)? {
        if len == 0 {
            return None;
        }
        let tag = generic(rd, FIELD_DEPTH)?;
        let tag = vstr(&tag)?;
        match tag {
            "BlockStored" => Some(Some(KvEvent::BlockStored(array_fields(
                rd,
                len,
                &STORED_FIELDS,
                stats,
                stored_field,
            )?))),
            "BlockRemoved" => Some(Some(KvEvent::BlockRemoved(array_fields(
                rd,
                len,
                &REMOVED_FIELDS,
                stats,
                removed_field,
            )?))),
            "AllBlocksCleared" => {
                skip(rd, len - 1)?;
                stats.unknown_fields += u32::try_from(len - 1).ok()?;
                Some(Some(KvEvent::AllBlocksCleared))
            }
            _ => {
                skip(rd, len - 1)?;
                Some(None)
            }
        }
    } else if let Some(len) = map_len(marker, rd)? {
        if len == 0 {
            return None;
        }
        // msgspec writes the tag first; other orders go to the full-tree decoder.
        let k = generic(rd, FIELD_DEPTH)?;
        if vstr(&k) != Some("type") {
            return None;
        }
        let tag = generic(rd, FIELD_DEPTH)?;
        let tag = vstr(&tag)?;
        match tag {
            "BlockStored" => Some(Some(KvEvent::BlockStored(map_fields(
                rd,
                len,
                &[&STORED_FIELDS, &STORED_MAP_ONLY],
                stats,
                stored_field,
            )?))),
            "BlockRemoved" => Some(Some(KvEvent::BlockRemoved(map_fields(
                rd,
                len,
                &[&REMOVED_FIELDS, &REMOVED_MAP_ONLY],
                stats,
                removed_field,
            )?))),
            "AllBlocksCleared" => {
                skip(rd, 2 * (len - 1))?;
                stats.unknown_fields += u32::try_from(len - 1).ok()?;
                Some(Some(KvEvent::AllBlocksCleared))
            }
            _ => {
                skip(rd, 2 * (len - 1))?;
                Some(None)
            }
        }
    } else {
        None
    }
}

/// The positional fields after the tag of an array-encoded event; extra positions are
/// skipped and counted.
#[inline]
fn array_fields<T: Default>(
    rd: &mut Rd<'_>,
    len: usize,
    names: &[&str],
    stats: &mut DecodeStats,
    field: impl Fn(&mut Rd<'_>, &mut T, &str) -> Option<()>,
) -> Option<T> {
    let mut t = T::default();
    for pos in 1..len {
        match names.get(pos) {
            Some(name) => field(rd, &mut t, name)?,
            None => {
                generic(rd, FIELD_DEPTH)?;
                stats.unknown_fields += 1;
            }
        }
    }
    Some(t)
}

/// The remaining key/value pairs of a map-encoded event (after its `type`); keys outside
/// `known` are skipped and counted.
#[inline]
fn map_fields<T: Default>(
    rd: &mut Rd<'_>,
    len: usize,
    known: &[&[&str]],
    stats: &mut DecodeStats,
    field: impl Fn(&mut Rd<'_>, &mut T, &str) -> Option<()>,
) -> Option<T> {
    let mut t = T::default();
    for _ in 1..len {
        let k = generic(rd, FIELD_DEPTH)?;
        match vstr(&k) {
            Some("type") => {
                generic(rd, FIELD_DEPTH)?;
            }
            Some(name) if known.iter().any(|names| names.contains(&name)) => {
                field(rd, &mut t, name)?
            }
            _ => {
                generic(rd, FIELD_DEPTH)?;
                stats.unknown_fields += 1;
            }
        }
    }
    Some(t)
}

fn stored_field(rd: &mut Rd<'_>, s: &mut BlockStored, name: &str) -> Option<()> {
    match name {
        "token_ids" => {
            if let Some(t) = attempt(rd, tokens) {
                s.token_ids = t;
                return Some(());
            }
        }
        "block_hashes" => {
            if let Some(h) = attempt(rd, hashes) {
                s.block_hashes = h;
                return Some(());
            }
        }
        "extra_keys" => {
            if let Some(n) = attempt(rd, all_nil_array) {
                s.extra_keys = Some(vec![None; n]);
                return Some(());
            }
        }
        _ => {}
    }
    let v = generic(rd, FIELD_DEPTH)?;
    ok(set_stored(s, name, v))
}

fn removed_field(rd: &mut Rd<'_>, r: &mut BlockRemoved, name: &str) -> Option<()> {
    if name == "block_hashes"
        && let Some(h) = attempt(rd, hashes)
    {
        r.block_hashes = h;
        return Some(());
    }
    let v = generic(rd, FIELD_DEPTH)?;
    ok(set_removed(r, name, v))
}

fn ok(r: R<()>) -> Option<()> {
    r.ok()
}

/// Runs `f` on a copy of the cursor and commits it only on success.
fn attempt<T>(rd: &mut Rd<'_>, f: impl FnOnce(&mut Rd<'_>) -> Option<T>) -> Option<T> {
    let mut probe = *rd;
    let out = f(&mut probe)?;
    *rd = probe;
    Some(out)
}

/// One value through rmpv with `depth` left, exactly as the full-tree decode reads it there.
fn generic<'a>(rd: &mut Rd<'a>, depth: usize) -> Option<Value<'a>> {
    rmpv::decode::read_value_ref_with_max_depth(rd, depth).ok()
}

fn skip(rd: &mut Rd<'_>, n: usize) -> Option<()> {
    for _ in 0..n {
        generic(rd, FIELD_DEPTH)?;
    }
    Some(())
}

/// `token_ids` whose items are all plain unsigned ints that fit `u32`.
fn tokens(rd: &mut Rd<'_>) -> Option<Vec<u32>> {
    let marker = byte(rd)?;
    let len = array_len(marker, rd)??;
    let mut out = Vec::with_capacity(len.min(rd.len()));
    for _ in 0..len {
        let t = match byte(rd)? {
            m @ 0x00..=0x7f => u32::from(m),
            0xcc => u32::from(byte(rd)?),
            0xcd => u32::from(u16::from_be_bytes(take(rd)?)),
            0xce => u32::from_be_bytes(take(rd)?),
            0xcf => u32::try_from(u64::from_be_bytes(take(rd)?)).ok()?,
            _ => return None,
        };
        out.push(t);
    }
    Some(out)
}

/// `block_hashes` of ints (any width, signed reinterpreted) or non-empty `bin`.
fn hashes(rd: &mut Rd<'_>) -> Option<Vec<BlockHash>> {
    let marker = byte(rd)?;
    let len = array_len(marker, rd)??;
    let mut out = Vec::with_capacity(len.min(rd.len()));
    for _ in 0..len {
        let h = match byte(rd)? {
            m @ 0x00..=0x7f => BlockHash::Int(u64::from(m)),
            m @ 0xe0..=0xff => BlockHash::Int(i64::from(i8::from_be_bytes([m])) as u64),
            0xcc => BlockHash::Int(u64::from(byte(rd)?)),
            0xcd => BlockHash::Int(u64::from(u16::from_be_bytes(take(rd)?))),
            0xce => BlockHash::Int(u64::from(u32::from_be_bytes(take(rd)?))),
            0xcf => BlockHash::Int(u64::from_be_bytes(take(rd)?)),
            0xd0 => BlockHash::Int(i64::from(i8::from_be_bytes(take(rd)?)) as u64),
            0xd1 => BlockHash::Int(i64::from(i16::from_be_bytes(take(rd)?)) as u64),
            0xd2 => BlockHash::Int(i64::from(i32::from_be_bytes(take(rd)?)) as u64),
            0xd3 => BlockHash::Int(i64::from_be_bytes(take(rd)?) as u64),
            0xc4 => {
                let n = usize::from(byte(rd)?);
                bin(rd, n)?
            }
            0xc5 => {
                let n = usize::from(u16::from_be_bytes(take(rd)?));
                bin(rd, n)?
            }
            0xc6 => {
                let n = usize::try_from(u32::from_be_bytes(take(rd)?)).ok()?;
                bin(rd, n)?
            }
            _ => return None,
        };
        out.push(h);
    }
    Some(out)
}

fn bin(rd: &mut Rd<'_>, n: usize) -> Option<BlockHash> {
    if n == 0 || rd.len() < n {
        return None;
    }
    let (b, rest) = rd.split_at(n);
    *rd = rest;
    Some(BlockHash::Bytes(b.to_vec()))
}

/// An array of only nils (the usual `extra_keys`); returns its length.
fn all_nil_array(rd: &mut Rd<'_>) -> Option<usize> {
    let marker = byte(rd)?;
    let len = array_len(marker, rd)??;
    for _ in 0..len {
        if byte(rd)? != 0xc0 {
            return None;
        }
    }
    Some(len)
}

fn byte(rd: &mut Rd<'_>) -> Option<u8> {
    let (&b, rest) = rd.split_first()?;
    *rd = rest;
    Some(b)
}

fn take<const N: usize>(rd: &mut Rd<'_>) -> Option<[u8; N]> {
    let (head, rest) = rd.split_first_chunk::<N>()?;
    *rd = rest;
    Some(*head)
}

/// `Some(Some(len))` for an array marker, `Some(None)` for any other marker, `None` when the
/// length is truncated.
fn array_len(marker: u8, rd: &mut Rd<'_>) -> Option<Option<usize>> {
    Some(match marker {
        0x90..=0x9f => Some(usize::from(marker & 0x0f)),
        0xdc => Some(usize::from(u16::from_be_bytes(take(rd)?))),
        0xdd => Some(usize::try_from(u32::from_be_bytes(take(rd)?)).ok()?),
        _ => None,
    })
}

/// Like [`array_len`] for map markers.
fn map_len(marker: u8, rd: &mut Rd<'_>) -> Option<Option<usize>> {
    Some(match marker {
        0x80..=0x8f => Some(usize::from(marker & 0x0f)),
        0xde => Some(usize::from(u16::from_be_bytes(take(rd)?))),
        0xdf => Some(usize::try_from(u32::from_be_bytes(take(rd)?)).ok()?),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::decode_batch_tree;
    use super::*;
    use crate::codec::{Encoding, encode_batch};
    use crate::event::ExtraKey;

    fn samples() -> Vec<Vec<u8>> {
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![
                BlockHash::Int(1),
                BlockHash::Int(u64::MAX),
                BlockHash::Bytes(vec![9; 32]),
            ],
            parent_block_hash: Some(BlockHash::Int(300)),
            token_ids: vec![0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX],
            block_size: 16,
            lora_name: Some("l".into()),
            medium: Some("CPU".into()),
            extra_keys: Some(vec![
                None,
                Some(vec![
                    ExtraKey::Str("s".into()),
                    ExtraKey::Mm {
                        identifier: "i".into(),
                        offset: -2,
                    },
                ]),
                None,
            ]),
            group_idx: Some(1),
            kv_cache_spec_kind: Some("sliding_window".into()),
            kv_cache_spec_sliding_window: Some(128),
            ..Default::default()
        });
        let plain = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::Int(0xdead_beef_0000_0001)],
            token_ids: (0..16).map(|t| t * 70_001).collect(),
            block_size: 16,
            extra_keys: Some(vec![None]),
            ..Default::default()
        });
        let removed = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(5), BlockHash::Int((-7i64) as u64)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..Default::default()
        });
        let events = vec![stored, plain, removed, KvEvent::AllBlocksCleared];
        let mut out = Vec::new();
        for enc in [Encoding::Map, Encoding::Array] {
            out.push(encode_batch(12.5, &events, Some(3), enc));
            out.push(encode_batch(0.0, &events[1..3], None, enc));
        }
        out
    }

    fn check(payload: &[u8]) -> bool {
        match decode_batch_fast(payload) {
            Some(fast) => {
                let tree = decode_batch_tree(payload).map_err(|e| e.to_string());
                assert_eq!(Ok(fast), tree, "{payload:02x?}");
                true
            }
            None => false,
        }
    }

    #[test]
    fn fast_path_agrees_with_tree_decoder() {
        let mut hits = 0usize;
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for base in samples() {
            assert!(check(&base), "fast path declined a plain batch");
            for cut in 0..base.len() {
                check(&base[..cut]);
            }
            for _ in 0..4_000 {
                let mut p = base.clone();
                for _ in 0..1 + seed % 3 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let i = (seed >> 8) as usize % p.len();
                    p[i] = (seed >> 40) as u8;
                }
                hits += usize::from(check(&p));
            }
        }
        assert!(hits > 0);
    }
}
