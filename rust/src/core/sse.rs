//! Server-sent-event frames as vLLM's OpenAI server writes them, built without Python:
//! a per-stream template around the one value that changes per token (the text, a JSON
//! string literal written as Python's `json.dumps(s, ensure_ascii=False)` writes it), and
//! the HTTP/1.1 chunk that carries a stream's frames to its connection.

/// A plain-delta frame of one stream: everything before the text's literal (`head`) and
/// after it (`tail`), fixed for the stream's life (ids, model, index are in them).
pub struct FrameTemplate {
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl FrameTemplate {
    /// A template from the bytes around the text.
    pub fn new(head: Vec<u8>, tail: Vec<u8>) -> Self {
        FrameTemplate { head, tail }
    }

    /// Appends the frame carrying `text` to `out`.
    pub fn render(&self, out: &mut Vec<u8>, text: &str) {
        out.extend_from_slice(&self.head);
        push_str_literal(out, text);
        out.extend_from_slice(&self.tail);
    }
}

/// `body` as one chunk of HTTP/1.1 chunked transfer encoding (lower-case hex size, as
/// uvicorn writes a streaming response's body); an empty body gives no bytes (an empty
/// chunk would end the response).
pub fn http_chunk(body: &[u8]) -> Vec<u8> {
    if body.is_empty() {
        return Vec::new();
    }
    let mut out = format!("{:x}\r\n", body.len()).into_bytes();
    out.reserve(body.len() + 2);
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n");
    out
}

/// Appends `s` to `out` as a JSON string literal, quotes included, escaped as Python's
/// `json` module escapes with `ensure_ascii=False`: `"` and `\` by a backslash, the five
/// control characters that have one by their short escape (`\b \f \n \r \t`), every other
/// character below U+0020 as `\u00xx` (lower-case hex); everything else, non-ASCII and
/// U+007F included, as its own UTF-8 bytes.
pub fn push_str_literal(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            0..=0x1f => 0,
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        if short != 0 {
            out.extend_from_slice(&[b'\\', short]);
        } else {
            out.extend_from_slice(b"\\u00");
            out.extend_from_slice(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::{http_chunk, push_str_literal, FrameTemplate};

    #[test]
    fn a_frame_is_head_literal_tail() {
        let t = FrameTemplate::new(b"data: {\"t\":".to_vec(), b"}\n\n".to_vec());
        let mut out = Vec::new();
        t.render(&mut out, "a\"b");
        t.render(&mut out, "");
        assert_eq!(out, b"data: {\"t\":\"a\\\"b\"}\n\ndata: {\"t\":\"\"}\n\n");
    }

    #[test]
    fn http_chunks_carry_their_size_in_lower_case_hex() {
        assert_eq!(http_chunk(b""), b"");
        assert_eq!(http_chunk(b"abc"), b"3\r\nabc\r\n");
        let body = vec![b'x'; 0x1af];
        let chunk = http_chunk(&body);
        assert!(chunk.starts_with(b"1af\r\nxx"));
        assert!(chunk.ends_with(b"x\r\n"));
        assert_eq!(chunk.len(), 0x1af + 7);
    }

    fn literal(s: &str) -> String {
        let mut out = Vec::new();
        push_str_literal(&mut out, s);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn plain_text_is_only_quoted() {
        assert_eq!(literal(""), "\"\"");
        assert_eq!(literal(" hello, world"), "\" hello, world\"");
    }

    #[test]
    fn quotes_backslashes_and_short_escapes() {
        assert_eq!(literal("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(literal("\n\r\t\u{8}\u{c}"), r#""\n\r\t\b\f""#);
    }

    #[test]
    fn other_controls_are_lower_case_unicode_escapes() {
        assert_eq!(literal("\u{0}\u{1f}\u{1b}x"), r#""\u0000\u001f\u001bx""#);
    }

    #[test]
    fn non_ascii_and_delete_stay_raw() {
        assert_eq!(
            literal("é日本\u{7f}\u{2028}🙂"),
            "\"é日本\u{7f}\u{2028}🙂\""
        );
    }
}
