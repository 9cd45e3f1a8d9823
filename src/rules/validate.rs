//! Checksums that tell a real card number or IBAN from a look-alike.

/// A checksum a match must pass to count as a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validator {
    /// Payment card numbers: 12 to 19 digits passing the Luhn check.
    Luhn,
    /// International bank account numbers: ISO 13616 mod-97.
    Iban,
}

impl Validator {
    pub fn parse(name: &str) -> Option<Validator> {
        match name {
            "luhn" => Some(Validator::Luhn),
            "iban" => Some(Validator::Iban),
            _ => None,
        }
    }

    /// Whether the matched text passes; separators (spaces, dashes, dots) are
    /// ignored.
    pub fn check(self, text: &str) -> bool {
        match self {
            Validator::Luhn => luhn(text),
            Validator::Iban => iban(text),
        }
    }
}

/// The Luhn check over the digits of `text`; any other character but common
/// separators fails it.
pub fn luhn(text: &str) -> bool {
    let mut digits = Vec::with_capacity(19);
    for c in text.chars() {
        match c {
            '0'..='9' => digits.push(c as u32 - '0' as u32),
            ' ' | '-' | '.' => {}
            _ => return false,
        }
    }
    if !(12..=19).contains(&digits.len()) {
        return false;
    }
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &d)| match (i % 2 == 1, d * 2) {
            (true, doubled) if doubled > 9 => doubled - 9,
            (true, doubled) => doubled,
            (false, _) => d,
        })
        .sum();
    sum.is_multiple_of(10)
}

/// The IBAN check: country code, check digits, 11 to 30 more characters, and
/// the whole, rotated and turned into digits, equal to 1 modulo 97.
pub fn iban(text: &str) -> bool {
    let compact: Vec<char> = text
        .chars()
        .filter(|c| !matches!(c, ' ' | '-' | '.'))
        .map(|c| c.to_ascii_uppercase())
        .collect();
    if !(15..=34).contains(&compact.len())
        || !compact[..2].iter().all(char::is_ascii_uppercase)
        || !compact[2..4].iter().all(char::is_ascii_digit)
        || !compact.iter().all(char::is_ascii_alphanumeric)
    {
        return false;
    }
    let rotated = compact[4..].iter().chain(&compact[..4]);
    let mut remainder = 0u32;
    for c in rotated {
        let value = c.to_digit(36).unwrap_or(0);
        remainder = if value < 10 {
            (remainder * 10 + value) % 97
        } else {
            (remainder * 100 + value) % 97
        };
    }
    remainder == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luhn_accepts_real_test_card_numbers() {
        assert!(luhn("4111 1111 1111 1111"));
        assert!(luhn("5500-0000-0000-0004"));
        assert!(luhn("378282246310005"));
    }

    #[test]
    fn luhn_rejects_look_alikes() {
        assert!(!luhn("4111 1111 1111 1112"));
        assert!(!luhn("1234 5678 9012 3456"));
        assert!(!luhn("4111"));
        assert!(!luhn("4111 1111 1111 111a"));
    }

    #[test]
    fn iban_accepts_valid_numbers() {
        assert!(iban("GB82 WEST 1234 5698 7654 32"));
        assert!(iban("DE89370400440532013000"));
        assert!(iban("fr14 2004 1010 0505 0001 3m02 606"));
    }

    #[test]
    fn iban_rejects_bad_check_digits_and_shapes() {
        assert!(!iban("GB82 WEST 1234 5698 7654 33"));
        assert!(!iban("DE00370400440532013000"));
        assert!(!iban("1289370400440532013000"));
        assert!(!iban("DE89"));
    }
}
