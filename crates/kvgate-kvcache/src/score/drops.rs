//! Finding the holdings dropped between two consecutive holder sets (see [`crate::score`]).

use crate::index::holders::Holding;

/// When the sorted set `q` is the sorted set `p` minus some holdings, fills `out` with their
/// positions in `p` and returns true. Each drop is found by galloping to the first position
/// where `p[x]` and `q[x - drops found so far]` disagree; `fp_xor` (the two fingerprints
/// XORed) then confirms that the dropped holdings explain the whole difference. Returns false
/// for any other change, and the caller merges instead.
pub(crate) fn dropped_only(
    p: &[Holding],
    q: &[Holding],
    fp_xor: u64,
    out: &mut Vec<usize>,
) -> bool {
    out.clear();
    let Some(d) = p.len().checked_sub(q.len()).filter(|d| *d > 0) else {
        return false;
    };
    // p[x] still sits at its place in q after `k` earlier drops (x >= k always holds here).
    let agree = |x: usize, k: usize| q.get(x - k).is_some_and(|h| h.same(&p[x]));
    let mut from = 0;
    for k in 0..d {
        // The first disagreement in [from, q.len() + k]; the upper end never agrees.
        let (mut lo, hi) = (from, q.len() + k);
        let mut step = 1;
        while lo < hi && agree(lo, k) {
            let probe = lo + step;
            if probe < hi && agree(probe, k) {
                lo = probe + 1;
                step *= 2;
                continue;
            }
            // Disagreement in (lo, min(probe, hi)]: bisect.
            let (mut a, mut b) = (lo + 1, probe.min(hi));
            while a < b {
                let mid = a + (b - a) / 2;
                if agree(mid, k) {
                    a = mid + 1;
                } else {
                    b = mid;
                }
            }
            lo = a;
            break;
        }
        out.push(lo);
        from = lo + 1;
    }
    out.iter().fold(fp_xor, |acc, &x| acc ^ p[x].mix()) == 0
}
