use super::*;
use crate::hashing::HashAlgo;
use kvgate_kvcache::ExtraKey as EventExtraKey;

fn mgr(blocks: usize) -> KvManager {
    KvManager::new(
        blocks,
        4,
        BlockHasher::with_seed(HashAlgo::Sha256Cbor, "vllm-none-hash"),
    )
}

fn stored(ev: &[KvEvent]) -> Vec<&BlockStored> {
    ev.iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

#[test]
fn prefill_then_hit_then_decode_block() {
    let mut m = mgr(10);
    let mut a = KvRequest::new((1..=10).collect(), None, None);
    m.update_hashes(&mut a);
    assert_eq!(a.block_hashes.len(), 2);
    assert!(m.allocate_slots(&mut a, 10, None));
    assert_eq!(a.groups[0].blocks.len(), 3);
    let ev = m.pool.take_events();
    let s = stored(&ev);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].block_hashes.len(), 2);
    assert_eq!(s[0].parent_block_hash, None);
    assert_eq!(s[0].token_ids, (1..=8).collect::<Vec<_>>());
    assert_eq!(s[0].extra_keys, Some(vec![None, None]));
    a.num_computed = 10;
    // Two decode tokens complete block 2 (tokens 9..12).
    for t in [11, 12] {
        a.tokens.push(t);
        m.update_hashes(&mut a);
        assert!(m.allocate_slots(&mut a, 1, None));
        a.num_computed += 1;
    }
    let ev = m.pool.take_events();
    let s = stored(&ev);
    assert_eq!(s.len(), 1, "only the step completing the block stores");
    assert_eq!(s[0].token_ids, vec![9, 10, 11, 12]);
    assert_eq!(
        s[0].parent_block_hash.as_ref().map(|h| h.to_u64()),
        Some(a.block_hashes[1].to_event_u64())
    );
    m.free(&mut a);

    // Same prompt again: hit capped at (len-1)/bs = 2 blocks.
    let mut b = KvRequest::new((1..=10).collect(), None, None);
    m.update_hashes(&mut b);
    let hit = m.find_hit(&b);
    assert_eq!(hit.tokens, 8);
    assert_eq!(hit.groups[0].len(), 2);
    assert!(m.allocate_slots(&mut b, 2, Some(&hit)));
    assert!(m.pool.take_events().is_empty(), "nothing new to store");
}

#[test]
fn extra_keys_change_hashes_and_appear_in_events() {
    let m = mgr(10);
    let lora = Arc::new(LoraAdapter {
        name: "ad".into(),
        path: "/p".into(),
        id: 1,
    });
    let mut plain = KvRequest::new((1..=8).collect(), None, None);
    let mut salted = KvRequest::new((1..=8).collect(), None, Some("s".into()));
    let mut lo = KvRequest::new((1..=8).collect(), Some(lora), None);
    for r in [&mut plain, &mut salted, &mut lo] {
        m.update_hashes(r);
    }
    assert_ne!(plain.block_hashes[0], salted.block_hashes[0]);
    assert_ne!(plain.block_hashes[0], lo.block_hashes[0]);
    let mut m = m;
    assert!(m.allocate_slots(&mut salted, 8, None));
    let ev = m.pool.take_events();
    assert_eq!(
        stored(&ev)[0].extra_keys,
        Some(vec![Some(vec![EventExtraKey::Str("s".into())]), None])
    );
}

/// Block size 4; an image at tokens 2..7 and another at 8..10 of a 13-token prompt (3 full
/// blocks): vLLM's per-block extra keys are `[("a", 2)]`, `[("a", -2)]`, `[("b", 0)]`.
#[test]
fn image_items_become_mm_extra_keys() {
    let mm = vec![
        MmFeature {
            identifier: "a".into(),
            offset: 2,
            length: 5,
        },
        MmFeature {
            identifier: "b".into(),
            offset: 8,
            length: 2,
        },
    ];
    let mut m = mgr(10);
    let mut img = KvRequest::new((1..=13).collect(), None, None).with_mm(mm);
    let mut text = KvRequest::new((1..=13).collect(), None, None);
    m.update_hashes(&mut img);
    m.update_hashes(&mut text);
    let key = |id: &str, offset| ExtraKey::Mm {
        identifier: id.into(),
        offset,
    };
    let hasher = BlockHasher::with_seed(HashAlgo::Sha256Cbor, "vllm-none-hash");
    let h0 = hasher.hash_block(None, &[1, 2, 3, 4], &[key("a", 2)]);
    let h1 = hasher.hash_block(Some(&h0), &[5, 6, 7, 8], &[key("a", -2)]);
    let h2 = hasher.hash_block(Some(&h1), &[9, 10, 11, 12], &[key("b", 0)]);
    assert_eq!(
        img.block_hashes,
        vec![h0, h1, h2],
        "chained over the extra keys"
    );
    // vLLM 0.33's `hash_block_tokens(sha256_cbor, …)` with these tokens and extra keys
    // (NONE_HASH from "vllm-none-hash"), as event u64s.
    let vllm: [u64; 3] = [
        14_729_549_956_329_983_236,
        5_575_366_703_362_950_158,
        4_662_408_401_312_086_423,
    ];
    let ours: Vec<u64> = img
        .block_hashes
        .iter()
        .map(BlockHash::to_event_u64)
        .collect();
    assert_eq!(ours, vllm);
    assert_ne!(img.block_hashes[0], text.block_hashes[0]);
    assert!(m.allocate_slots(&mut img, 13, None));
    let ev = m.pool.take_events();
    let ev_key = |id: &str, offset| EventExtraKey::Mm {
        identifier: id.into(),
        offset,
    };
    assert_eq!(
        stored(&ev)[0].extra_keys,
        Some(vec![
            Some(vec![ev_key("a", 2)]),
            Some(vec![ev_key("a", -2)]),
            Some(vec![ev_key("b", 0)]),
        ])
    );
}

#[test]
fn allocation_failure_changes_nothing() {
    let mut m = mgr(3);
    let mut a = KvRequest::new((1..=12).collect(), None, None);
    m.update_hashes(&mut a);
    assert!(!m.allocate_slots(&mut a, 12, None));
    assert!(a.groups[0].blocks.is_empty());
    assert_eq!(m.pool.num_free(), 2);
}

/// A hybrid manager: window `w` tokens over blocks of `bs`, `blocks` in the shared pool.
fn hybrid(blocks: usize, bs: usize, w: usize) -> KvManager {
    KvManager::new(
        blocks,
        bs,
        BlockHasher::with_seed(HashAlgo::Sha256Cbor, "vllm-none-hash"),
    )
    .with_hybrid_window(Some(w))
}

fn event_hashes(hashes: &[BlockHash]) -> Vec<u64> {
    hashes.iter().map(BlockHash::to_event_u64).collect()
}

fn wire(s: &BlockStored) -> Vec<u64> {
    s.block_hashes.iter().map(|h| h.to_u64()).collect()
}

/// What vLLM 0.32 published for a 514-token prompt on Gemma3 (window 128, block size 32):
/// per span one `BlockStored` per group, the window group's first, both with the span's
/// tokens and parent; the window group lists blocks 12-15, the full group all 16; the decode
/// block 16 gets a window event with no hashes.
#[test]
fn hybrid_prefill_and_decode_events_match_vllm() {
    let mut m = hybrid(200, 32, 128);
    let mut a = KvRequest::new((1..=514).collect(), None, None);
    m.update_hashes(&mut a);
    assert!(m.allocate_slots(&mut a, 514, None));
    assert_eq!(m.pool.num_free(), 199 - 2 * 17, "17 blocks per group");
    let ev = m.pool.take_events();
    let s = stored(&ev);
    assert_eq!(s.len(), 2);
    let (win, full) = (s[0], s[1]);
    assert_eq!(win.group_idx, Some(0));
    assert_eq!(win.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    assert_eq!(win.kv_cache_spec_sliding_window, Some(128));
    assert_eq!(wire(win), event_hashes(&a.block_hashes[12..16]));
    assert_eq!(win.extra_keys, Some(vec![None; 4]));
    assert_eq!(full.group_idx, Some(1));
    assert_eq!(full.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(full.kv_cache_spec_sliding_window, None);
    assert_eq!(wire(full), event_hashes(&a.block_hashes[..16]));
    for e in [win, full] {
        assert_eq!(e.parent_block_hash, None);
        assert_eq!(e.token_ids, (1..=512).collect::<Vec<_>>());
        assert_eq!(e.block_size, 32);
    }
    a.num_computed = 514;
    // Decode to 544 tokens: the first step frees window blocks 0-11 (out of the window), the
    // last one block 12 (cached: it stays in the prefix cache) and stores block 16.
    for t in 515..=544 {
        a.tokens.push(t);
        m.update_hashes(&mut a);
        assert!(m.allocate_slots(&mut a, 1, None));
        a.num_computed += 1;
        let kept = a.groups[0]
            .blocks
            .iter()
            .filter(|&&b| b != NULL_BLOCK)
            .count();
        let want = if t < 544 { 17 - 12 } else { 17 - 13 };
        assert_eq!(kept, want, "window blocks held at {t} tokens");
    }
    assert!(a.groups[0].blocks[..13].iter().all(|&b| b == NULL_BLOCK));
    assert_eq!(a.groups[1].blocks.len(), 17);
    let ev = m.pool.take_events();
    let s = stored(&ev);
    assert_eq!(s.len(), 2, "{ev:?}");
    let (win, full) = (s[0], s[1]);
    assert_eq!((win.group_idx, full.group_idx), (Some(0), Some(1)));
    assert!(win.block_hashes.is_empty());
    assert_eq!(win.extra_keys, None, "no entries");
    assert_eq!(wire(full), event_hashes(&a.block_hashes[16..17]));
    let parent = Some(a.block_hashes[15].to_event_u64());
    for e in [win, full] {
        assert_eq!(e.parent_block_hash.as_ref().map(|h| h.to_u64()), parent);
        assert_eq!(e.token_ids, (513..=544).collect::<Vec<_>>());
    }
    m.free(&mut a);
    assert_eq!(m.pool.num_free(), 199, "every group's blocks back");
    // Cached: the window's 4 and the full group's 17.
    assert_eq!(m.pool.num_cached_hashes(), 4 + 17);
}

/// The hybrid hit for a 514-token prompt (at most 16 blocks), the groups' holdings set block
/// by block; each row changes one holding.
#[test]
fn hybrid_hit_table() {
    let range = |a: usize, b: usize| (a..b).collect::<Vec<_>>();
    let cases: Vec<(&str, usize, Vec<usize>, usize, usize)> = vec![
        ("both hold everything", 514, range(0, 16), 16, 512),
        (
            "the window's tail, as the engine leaves it",
            514,
            range(12, 16),
            16,
            512,
        ),
        ("the run ends a block early", 514, range(11, 15), 16, 480),
        (
            "a gap in the run, block 0 not held",
            514,
            vec![12, 13, 15],
            16,
            0,
        ),
        (
            "no run: the blocks from 0",
            514,
            vec![0, 1, 13, 14, 15],
            16,
            64,
        ),
        (
            "full holds 10: the window's tail is past it",
            514,
            range(12, 16),
            10,
            0,
        ),
        ("full holds 10, the window 6-9", 514, range(6, 10), 10, 320),
        (
            "a 512-token resend is capped at 15 blocks",
            512,
            range(0, 16),
            16,
            480,
        ),
    ];
    for (name, prompt_len, window, full, want) in cases {
        let mut m = hybrid(100, 32, 128);
        let mut r = KvRequest::new((1..=prompt_len as u32).collect(), None, None);
        m.update_hashes(&mut r);
        let mut held = Vec::new();
        for (g, blocks) in [(0u8, window.clone()), (1, range(0, full))] {
            for i in blocks.into_iter().filter(|&i| i < r.block_hashes.len()) {
                let b = m.pool.get_new_blocks(1).unwrap()[0];
                m.pool.insert_hash(b, r.block_hashes[i], g);
                held.push(b);
            }
        }
        m.pool.free_blocks(held);
        let hit = m.find_hit(&r);
        assert_eq!(hit.tokens, want, "{name}");
        for blocks in &hit.groups {
            assert_eq!(blocks.len(), want / 32, "{name}");
        }
        // The hit allocates: every group's non-null hit blocks are taken, the rest computed.
        assert!(
            m.allocate_slots(&mut r, prompt_len - want, Some(&hit)),
            "{name}"
        );
        assert_eq!(r.groups[1].blocks[..want / 32], hit.groups[1][..], "{name}");
    }
}

/// Block size 4, window 8 (runs of 2), null + 8 blocks. A (13 tokens) fills the pool: 4 blocks
/// per group, the window caching blocks 1-2 (a hit of 3 blocks). B then evicts A's window blocks 2 and 1 and its
/// full block 2, one `BlockRemoved` each with its group; A's full prefix of 2 blocks is left,
/// but no window block within it, so A hits nothing.
#[test]
fn hybrid_eviction_names_each_group_and_cuts_the_hit() {
    let mut m = hybrid(9, 4, 8);
    let mut a = KvRequest::new((1..=13).collect(), None, None);
    m.update_hashes(&mut a);
    assert!(m.allocate_slots(&mut a, 13, None));
    let s = m.pool.take_events();
    assert_eq!(wire(stored(&s)[0]), event_hashes(&a.block_hashes[1..3]));
    assert_eq!(wire(stored(&s)[1]), event_hashes(&a.block_hashes[..3]));
    m.free(&mut a);
    assert_eq!(m.find_hit(&a).tokens, 12, "window 1-2 and full 0-2 held");
    let mut b = KvRequest::new((100..109).collect(), None, None);
    m.update_hashes(&mut b);
    assert!(m.allocate_slots(&mut b, 9, None));
    let removed: Vec<(u64, Option<i64>)> = m
        .pool
        .take_events()
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => Some((r.block_hashes[0].to_u64(), r.group_idx)),
            _ => None,
        })
        .collect();
    let h = |i: usize| a.block_hashes[i].to_event_u64();
    assert_eq!(
        removed,
        vec![(h(2), Some(0)), (h(1), Some(0)), (h(2), Some(1))]
    );
    let mut again = KvRequest::new((1..=13).collect(), None, None);
    m.update_hashes(&mut again);
    let hit = m.find_hit(&again);
    assert_eq!(hit.tokens, 0);
}
