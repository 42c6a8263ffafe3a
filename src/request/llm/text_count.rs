//! Word and character counts of a text ([`TextCount`]), read piece by piece: the `simple_word`
//! estimate of a prompt and of a streamed completion.

/// Word and character counts of a text, accumulated piece by piece (a word split across two
/// streamed pieces counts once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TextCount {
    pub words: u64,
    pub chars: u64,
    in_word: bool,
}

impl TextCount {
    /// Counts `text` (Unicode whitespace separates words). ASCII, most of any prompt, is
    /// classified byte by byte; other characters are decoded one at a time.
    pub fn add(&mut self, text: &str) {
        let bytes = text.as_bytes();
        let mut at = 0;
        while let Some(&b) = bytes.get(at) {
            let space = if b < 0x80 {
                at += 1;
                // `char::is_whitespace` on ASCII: tab, line feed, vertical tab, form feed,
                // carriage return and space.
                matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
            } else {
                let Some(c) = text.get(at..).and_then(|rest| rest.chars().next()) else {
                    break;
                };
                at += c.len_utf8();
                c.is_whitespace()
            };
            self.chars += 1;
            if space {
                self.in_word = false;
            } else if !self.in_word {
                self.in_word = true;
                self.words += 1;
            }
        }
    }

    /// Ends a piece of text: the next one starts a new word (message boundaries).
    pub fn separate(&mut self) {
        self.in_word = false;
    }

    /// The `simple_word` estimate: ⌈words × 4 / 3⌉ (English averages ¾ word per token), but
    /// never below ⌈chars / 4⌉ (code, URLs and unspaced scripts have more tokens than words).
    pub fn tokens(&self) -> u64 {
        (self.words * 4).div_ceil(3).max(self.chars.div_ceil(4))
    }
}
