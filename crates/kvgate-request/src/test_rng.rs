//! A small deterministic generator for the randomized tests (no dependency, the same draws on
//! every run).

pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    /// A draw in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }

    /// One of `from`, uniformly.
    pub(crate) fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len() as u64) as usize]
    }
}
