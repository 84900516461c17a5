//! msgpack → [`KvEventBatch`], accepting every shape vLLM and SGLang have shipped (§1.11).

use rmpv::ValueRef as Value;

use crate::event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, KvEventBatch};

mod fast;

/// Deepest nesting a valid batch needs is 6 (batch → events → event → extra_keys → entry →
/// `[id, offset]`); anything much deeper is garbage, and a low bound keeps recursion cheap.
const MAX_DEPTH: usize = 16;

/// Why a payload could not be decoded as a batch. Individual bad events are not errors: they
/// are skipped and counted in [`DecodeStats`].
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not one well-formed msgpack value (truncated, garbage, too deep).
    #[error("invalid msgpack payload")]
    Msgpack(#[source] rmpv::decode::Error),
    /// Bytes left over after the batch value.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    /// The value is not an array of 2–3 elements or a map with `events`.
    #[error("payload is not an event batch: {0}")]
    NotABatch(&'static str),
}

/// Counters of what the decoder skipped inside an otherwise valid batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Events with an unknown tag (skipped).
    pub unknown_events: u32,
    /// Unknown map keys or extra positional elements (ignored).
    pub unknown_fields: u32,
    /// Events whose known fields had the wrong type (skipped).
    pub malformed_events: u32,
}

/// Decodes one `KVEventBatch` payload (frame 2 of a live message).
///
/// # Errors
/// [`DecodeError`] when the payload is not a batch at all; single malformed or unknown events
/// are skipped and counted in the returned [`DecodeStats`] instead.
pub fn decode_batch(payload: &[u8]) -> Result<(KvEventBatch, DecodeStats), DecodeError> {
    match fast::decode_batch_fast(payload) {
        Some(out) => Ok(out),
        None => decode_batch_tree(payload),
    }
}

/// The full-tree decoder: reference semantics, used for every shape the fast path declines.
fn decode_batch_tree(payload: &[u8]) -> Result<(KvEventBatch, DecodeStats), DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(DecodeError::Msgpack)?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let mut stats = DecodeStats::default();
    let (ts, events, rank) = match value {
        Value::Array(items) => {
            if !(2..=3).contains(&items.len()) {
                return Err(DecodeError::NotABatch(
                    "array batch must have 2 or 3 elements",
                ));
            }
            let mut it = items.into_iter();
            let ts = it.next().unwrap_or(Value::Nil);
            let events = it.next().unwrap_or(Value::Nil);
            let rank = it.next().unwrap_or(Value::Nil);
            (ts, events, rank)
        }
        Value::Map(pairs) => {
            let (mut ts, mut events, mut rank) = (Value::Nil, None, Value::Nil);
            for (k, v) in pairs {
                match vstr(&k) {
                    Some("ts") => ts = v,
                    Some("events") => events = Some(v),
                    Some("data_parallel_rank") => rank = v,
                    _ => stats.unknown_fields += 1,
                }
            }
            (
                ts,
                events.ok_or(DecodeError::NotABatch("map batch without events"))?,
                rank,
            )
        }
        _ => return Err(DecodeError::NotABatch("neither array nor map")),
    };
    let ts = match ts {
        Value::Nil => 0.0,
        Value::F64(f) => f,
        Value::F32(f) => f64::from(f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        _ => return Err(DecodeError::NotABatch("ts is not a number")),
    };
    let data_parallel_rank = match rank {
        Value::Nil => None,
        Value::Integer(i) => i.as_i64(),
        _ => return Err(DecodeError::NotABatch("data_parallel_rank is not an int")),
    };
    let Value::Array(raw_events) = events else {
        return Err(DecodeError::NotABatch("events is not an array"));
    };
    let mut out = Vec::with_capacity(raw_events.len());
    for ev in raw_events {
        match decode_event(ev, &mut stats) {
            Ok(Some(e)) => out.push(e),
            Ok(None) => stats.unknown_events += 1,
            Err(Malformed) => stats.malformed_events += 1,
        }
    }
    Ok((
        KvEventBatch {
            ts,
            events: out,
            data_parallel_rank,
        },
        stats,
    ))
}

/// A known event whose fields had the wrong type.
struct Malformed;

type R<T> = Result<T, Malformed>;

fn decode_event(ev: Value<'_>, stats: &mut DecodeStats) -> R<Option<KvEvent>> {
    match ev {
        Value::Array(items) => {
            let mut it = items.into_iter();
            let tag = it.next().ok_or(Malformed)?;
            let tag = vstr(&tag).ok_or(Malformed)?;
            let fields: Vec<(usize, Value)> = it.enumerate().map(|(i, v)| (i + 1, v)).collect();
            match tag {
                "BlockStored" => {
                    let mut s = BlockStored::default();
                    for (pos, v) in fields {
                        match STORED_FIELDS.get(pos) {
                            Some(name) => set_stored(&mut s, name, v)?,
                            None => stats.unknown_fields += 1,
                        }
                    }
                    Ok(Some(KvEvent::BlockStored(s)))
                }
                "BlockRemoved" => {
                    let mut r = BlockRemoved::default();
                    for (pos, v) in fields {
                        match REMOVED_FIELDS.get(pos) {
                            Some(name) => set_removed(&mut r, name, v)?,
                            None => stats.unknown_fields += 1,
                        }
                    }
                    Ok(Some(KvEvent::BlockRemoved(r)))
                }
                "AllBlocksCleared" => {
                    stats.unknown_fields += fields.len() as u32;
                    Ok(Some(KvEvent::AllBlocksCleared))
                }
                _ => Ok(None),
            }
        }
        Value::Map(pairs) => {
            let tag = pairs
                .iter()
                .find(|(k, _)| vstr(k) == Some("type"))
                .and_then(|(_, v)| vstr(v))
                .ok_or(Malformed)?;
            match tag {
                "BlockStored" => {
                    let mut s = BlockStored::default();
                    for (k, v) in pairs {
                        match vstr(&k) {
                            Some("type") => {}
                            Some(name)
                                if STORED_FIELDS.contains(&name)
                                    || STORED_MAP_ONLY.contains(&name) =>
                            {
                                set_stored(&mut s, name, v)?
                            }
                            _ => stats.unknown_fields += 1,
                        }
                    }
                    Ok(Some(KvEvent::BlockStored(s)))
                }
                "BlockRemoved" => {
                    let mut r = BlockRemoved::default();
                    for (k, v) in pairs {
                        match vstr(&k) {
                            Some("type") => {}
                            Some(name)
                                if REMOVED_FIELDS.contains(&name)
                                    || REMOVED_MAP_ONLY.contains(&name) =>
                            {
                                set_removed(&mut r, name, v)?
                            }
                            _ => stats.unknown_fields += 1,
                        }
                    }
                    Ok(Some(KvEvent::BlockRemoved(r)))
                }
                "AllBlocksCleared" => {
                    stats.unknown_fields += pairs.len().saturating_sub(1) as u32;
                    Ok(Some(KvEvent::AllBlocksCleared))
                }
                _ => Ok(None),
            }
        }
        _ => Err(Malformed),
    }
}

/// Positional layout of `BlockStored` (index 0 is the tag), vLLM ≤ 0.23.
pub(crate) const STORED_FIELDS: [&str; 12] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
/// `BlockStored` fields that only exist in map form (0.33), plus SGLang's `cache_salt`.
const STORED_MAP_ONLY: [&str; 4] = ["locality", "ownership", "session_id", "lookahead_token_ids"];
/// Positional layout of `BlockRemoved`.
pub(crate) const REMOVED_FIELDS: [&str; 4] = ["type", "block_hashes", "medium", "group_idx"];
const REMOVED_MAP_ONLY: [&str; 2] = ["locality", "ownership"];

fn set_stored(s: &mut BlockStored, name: &str, v: Value<'_>) -> R<()> {
    match name {
        "block_hashes" => s.block_hashes = hashes(v)?,
        "parent_block_hash" => s.parent_block_hash = opt(v, hash)?,
        "token_ids" => s.token_ids = tokens(v)?,
        "block_size" => {
            s.block_size = opt(v, |v| {
                v.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or(Malformed)
            })?
            .unwrap_or(0)
        }
        "lora_id" => s.lora_id = opt(v, int)?,
        "medium" => s.medium = opt(v, string)?,
        "lora_name" => s.lora_name = opt(v, string)?,
        "extra_keys" => s.extra_keys = opt(v, extra_keys)?,
        "group_idx" => s.group_idx = opt(v, int)?,
        "kv_cache_spec_kind" => s.kv_cache_spec_kind = opt(v, string)?,
        "kv_cache_spec_sliding_window" => s.kv_cache_spec_sliding_window = opt(v, int)?,
        "locality" => s.locality = opt(v, string)?,
        "ownership" => s.ownership = opt(v, string)?,
        "session_id" => s.session_id = opt(v, string)?,
        "lookahead_token_ids" => {
            s.lookahead_token_ids = opt(v, |v| array(v)?.into_iter().map(tokens).collect())?
        }
        _ => {}
    }
    Ok(())
}

fn set_removed(r: &mut BlockRemoved, name: &str, v: Value<'_>) -> R<()> {
    match name {
        "block_hashes" => r.block_hashes = hashes(v)?,
        "medium" => r.medium = opt(v, string)?,
        "group_idx" => r.group_idx = opt(v, int)?,
        "locality" => r.locality = opt(v, string)?,
        "ownership" => r.ownership = opt(v, string)?,
        _ => {}
    }
    Ok(())
}

fn opt<'a, T>(v: Value<'a>, f: impl FnOnce(Value<'a>) -> R<T>) -> R<Option<T>> {
    match v {
        Value::Nil => Ok(None),
        v => f(v).map(Some),
    }
}

fn array(v: Value<'_>) -> R<Vec<Value<'_>>> {
    match v {
        Value::Array(a) => Ok(a),
        _ => Err(Malformed),
    }
}

fn int(v: Value<'_>) -> R<i64> {
    match v {
        Value::Integer(i) => i
            .as_i64()
            .or_else(|| i.as_u64().map(|u| u as i64))
            .ok_or(Malformed),
        _ => Err(Malformed),
    }
}

fn string(v: Value<'_>) -> R<String> {
    match v {
        Value::String(s) => s.as_str().map(str::to_owned).ok_or(Malformed),
        _ => Err(Malformed),
    }
}

/// An engine hash: any int width, signed ints reinterpreted, or `bin`.
fn hash(v: Value<'_>) -> R<BlockHash> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(BlockHash::Int(u)),
            (None, Some(s)) => Ok(BlockHash::Int(s as u64)),
            _ => Err(Malformed),
        },
        Value::Binary(b) if !b.is_empty() => Ok(BlockHash::Bytes(b.to_vec())),
        _ => Err(Malformed),
    }
}

fn hashes(v: Value<'_>) -> R<Vec<BlockHash>> {
    array(v)?.into_iter().map(hash).collect()
}

fn tokens(v: Value<'_>) -> R<Vec<u32>> {
    array(v)?
        .into_iter()
        .map(|t| match t {
            Value::Integer(i) => i
                .as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or(Malformed),
            _ => Err(Malformed),
        })
        .collect()
}

fn extra_keys(v: Value<'_>) -> R<Vec<Option<Vec<ExtraKey>>>> {
    array(v)?
        .into_iter()
        .map(|entry| {
            opt(entry, |e| {
                Ok(array(e)?.into_iter().map(extra_key).collect())
            })
        })
        .collect()
}

fn extra_key(v: Value<'_>) -> ExtraKey {
    match v {
        Value::String(s) => match s.as_str() {
            Some(s) => ExtraKey::Str(s.to_owned()),
            None => ExtraKey::Other("<non-utf8>".into()),
        },
        Value::Binary(b) => ExtraKey::Bytes(b.to_vec()),
        Value::Array(items) => match items.as_slice() {
            [Value::String(id), off, ..] if id.as_str().is_some() => ExtraKey::Mm {
                identifier: id.as_str().unwrap_or_default().to_owned(),
                offset: match off {
                    Value::Integer(i) => i.as_i64().unwrap_or(0),
                    _ => 0,
                },
            },
            _ => ExtraKey::Other(Value::Array(items).to_owned().to_string()),
        },
        other => ExtraKey::Other(other.to_owned().to_string()),
    }
}

fn vstr<'v>(v: &'v Value<'_>) -> Option<&'v str> {
    match v {
        Value::String(s) => s.as_str(),
        _ => None,
    }
}
