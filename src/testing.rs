//! Helpers of the crate's own tests.

/// A small deterministic generator (a 64-bit LCG), so that every run of a
/// randomized test makes the same inputs and a failure can be replayed.
pub(crate) struct Lcg(pub u64);

impl Lcg {
    /// A number below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
