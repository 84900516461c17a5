//! Deterministic output text: token ids drawn from the tokenizer's plain-word tokens with a
//! per-request seeded PRNG (the request's `seed`, else a hash of its prompt tokens), so the
//! same request always produces the same text and the text re-tokenizes to the same ids.

use tokenizers::Tokenizer;

/// The words the simulator generates from.
#[derive(Debug, Clone)]
pub struct OutputVocab {
    ids: Vec<u32>,
    texts: Vec<String>,
    index: std::collections::HashMap<u32, usize>,
}

/// Byte-level BPE marks a leading space with `Ġ`.
const SPACE_MARK: char = 'Ġ';

impl OutputVocab {
    /// Plain lowercase word tokens with a leading space (`Ġword`, 3–10 letters).
    ///
    /// Falls back to a small fixed set when the vocabulary has none (ids then still come
    /// from the vocabulary when present, else are synthetic).
    pub fn from_tokenizer(tok: &Tokenizer) -> OutputVocab {
        let mut words: Vec<(u32, String)> = tok
            .get_vocab(false)
            .into_iter()
            .filter_map(|(s, id)| {
                let rest = s.strip_prefix(SPACE_MARK)?;
                let ok =
                    (3..=10).contains(&rest.len()) && rest.bytes().all(|b| b.is_ascii_lowercase());
                ok.then(|| (id, format!(" {rest}")))
            })
            .collect();
        words.sort_unstable();
        if words.is_empty() {
            words = ["lorem", "ipsum", "dolor", "sit", "amet"]
                .iter()
                .enumerate()
                .map(|(i, w)| (tok.token_to_id(w).unwrap_or(i as u32), format!(" {w}")))
                .collect();
        }
        OutputVocab::from_words(words)
    }

    fn from_words(words: Vec<(u32, String)>) -> OutputVocab {
        let (ids, texts): (Vec<u32>, Vec<String>) = words.into_iter().unzip();
        let index = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        OutputVocab { ids, texts, index }
    }

    /// The initial PRNG state of a request.
    pub fn seed_for(seed: Option<i64>, prompt: &[u32]) -> u64 {
        match seed {
            Some(s) => s as u64 ^ 0x9E37_79B9_7F4A_7C15,
            None => {
                let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
                xxhash_rust::xxh3::xxh3_64(&bytes)
            }
        }
    }

    /// Draws the next token id (SplitMix64).
    pub fn sample(&self, state: &mut u64) -> u32 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        self.ids[(z % self.ids.len() as u64) as usize]
    }

    /// The text of a generated token (empty for ids this vocabulary did not produce).
    pub fn text(&self, id: u32) -> &str {
        self.index.get(&id).map_or("", |&i| self.texts[i].as_str())
    }

    /// Number of candidate words.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no candidate words (never true after construction).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_per_seed() {
        let v =
            OutputVocab::from_words(vec![(5, " a".into()), (9, " b".into()), (11, " c".into())]);
        let run = |seed| {
            let mut s = OutputVocab::seed_for(seed, &[1, 2, 3]);
            (0..20).map(|_| v.sample(&mut s)).collect::<Vec<_>>()
        };
        assert_eq!(run(None), run(None));
        assert_eq!(run(Some(7)), run(Some(7)));
        assert_ne!(run(Some(7)), run(Some(8)));
        assert_eq!(v.text(9), " b");
        assert_eq!(v.text(4), "");
    }
}
