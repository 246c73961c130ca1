//! Decoding runs of token ids: through the `tokenizers` crate, or, for byte-level BPE
//! tokenizers (GPT-2 style: the decoder is `ByteLevel` alone), through a per-id table of
//! raw bytes, which gives the same string for a fraction of the cost.
//!
//! The crate's decode of such a tokenizer maps each kept token's characters back to
//! bytes (or takes the token's own UTF-8 when a character is outside the byte alphabet),
//! joins the bytes of all tokens and decodes them lossily (U+FFFD for what is not UTF-8).
//! The table holds each id's bytes and whether it is special, so a decode is a
//! concatenation and one lossy conversion. [`TextDecoder::new`] checks the table against
//! the crate for every id before it uses it.

use tokenizers::{DecoderWrapper, Tokenizer};

/// The crate's error, as text.
#[derive(Debug)]
pub struct DecodeError(pub String);

/// Each id's bytes and whether it is a special token (skipped on request).
#[derive(Debug)]
struct ByteTokens {
    bytes: Vec<Box<[u8]>>,
    special: Vec<bool>,
}

/// The byte each character of the byte-level alphabet stands for (GPT-2's table: the
/// printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onwards).
fn char_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(256 + shifted).expect("U+0100..U+0143");
                shifted += 1;
                (c, b)
            }
        })
        .collect()
}

impl ByteTokens {
    fn build(tokenizer: &Tokenizer) -> Self {
        let table = char_to_byte();
        let count = tokenizer.get_vocab_size(true);
        let added = tokenizer.get_added_vocabulary();
        let mut bytes = Vec::with_capacity(count);
        let mut special = Vec::with_capacity(count);
        for id in 0..count as u32 {
            let Some(token) = tokenizer.id_to_token(id) else {
                bytes.push(Box::default());
                special.push(false);
                continue;
            };
            let mapped: Option<Vec<u8>> = token.chars().map(|c| table.get(&c).copied()).collect();
            bytes.push(
                mapped
                    .unwrap_or_else(|| token.as_bytes().to_vec())
                    .into_boxed_slice(),
            );
            special.push(added.is_special_token(&token));
        }
        ByteTokens { bytes, special }
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut joined = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let i = id as usize;
            // Ids outside the vocabulary decode to nothing, as in the crate.
            if i < self.bytes.len() && !(skip_special_tokens && self.special[i]) {
                joined.extend_from_slice(&self.bytes[i]);
            }
        }
        match String::from_utf8(joined) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }
}

/// A tokenizer's decode, fast where the tokenizer allows it.
pub struct TextDecoder {
    tokenizer: Tokenizer,
    bytes: Option<ByteTokens>,
}

impl TextDecoder {
    /// Wraps `tokenizer`; byte-level tokenizers get the byte table when it decodes every
    /// id as the crate does (with special tokens kept and skipped).
    pub fn new(tokenizer: Tokenizer) -> Self {
        let bytes = match tokenizer.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => Some(ByteTokens::build(&tokenizer)),
            _ => None,
        }
        .filter(|table| {
            (0..table.bytes.len() as u32).all(|id| {
                [false, true].iter().all(|&skip| {
                    tokenizer.decode(&[id], skip).ok().as_deref()
                        == Some(table.decode(&[id], skip).as_str())
                })
            })
        });
        TextDecoder { tokenizer, bytes }
    }

    /// Whether decodes go through the byte table.
    pub fn uses_byte_table(&self) -> bool {
        self.bytes.is_some()
    }

    /// The text of `ids` (special tokens left out when `skip_special_tokens`).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, DecodeError> {
        match &self.bytes {
            Some(table) => Ok(table.decode(ids, skip_special_tokens)),
            None => self
                .tokenizer
                .decode(ids, skip_special_tokens)
                .map_err(|e| DecodeError(e.to_string())),
        }
    }
}
