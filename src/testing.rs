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

    /// `text` cut into pieces of 1 to `most` bytes (longer only to end on
    /// a character's boundary), as an upstream's deltas may cut it.
    pub fn pieces<'t>(&mut self, text: &'t str, most: usize) -> Vec<&'t str> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = (1 + self.below(most)).min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            pieces.push(&rest[..cut]);
            rest = &rest[cut..];
        }
        pieces
    }
}

/// `c` as JSON's `\uXXXX` escapes (two for a character beyond the BMP),
/// as Python's `json.dumps` writes every character but ASCII.
pub(crate) fn unicode_escaped(c: char) -> String {
    c.encode_utf16(&mut [0; 2])
        .iter()
        .map(|unit| format!("\\u{unit:04x}"))
        .collect()
}
