//! Server-sent-event frames as vLLM's OpenAI server writes them, built without Python:
//! a per-stream template around the values that change per chunk (the text, a JSON string
//! literal written as Python's `json.dumps(s, ensure_ascii=False)` writes it; the logprobs;
//! where the stream carries them, the token ids and the running usage), and the HTTP/1.1
//! chunk that carries a stream's frames to its connection.

/// A chunk of one stream with two holes: the text's literal, between `head` and `mid`, and
/// the chunk's logprobs (a JSON value: `null` without), between `mid` and `tail`; and, for a
/// stream whose chunks carry them, more after the logprobs, in this order: the chunk's token
/// ids (`return_token_ids`: `ids_mid`, then a JSON array) and its running usage
/// (`continuous_usage_stats`: see `UsageHoles`). The rest is fixed for the stream's life
/// (ids, model, index).
pub struct FrameTemplate {
    head: Vec<u8>,
    mid: Vec<u8>,
    ids_mid: Option<Vec<u8>>,
    usage: Option<UsageHoles>,
    tail: Vec<u8>,
}

/// The holes of a chunk's running usage, `{"prompt_tokens":P,"total_tokens":T,
/// "completion_tokens":C}` as vLLM's model writes it: the bytes before the total (the
/// prompt's count among them) and between the total and the completion tokens.
pub struct UsageHoles {
    /// The bytes between the hole before (logprobs or ids) and the total.
    pub before_total: Vec<u8>,
    /// The bytes between the total and the completion tokens.
    pub before_completion: Vec<u8>,
    /// The prompt's tokens, which the total counts.
    pub prompt_tokens: usize,
}

/// What fills one frame's holes.
pub struct FrameValues<'a> {
    /// The chunk's new text.
    pub text: &'a str,
    /// The chunk's logprobs as JSON (None: `null`).
    pub logprobs: Option<&'a [u8]>,
    /// The chunk's token ids (written where the template has their hole).
    pub ids: &'a [i64],
    /// The sample's output tokens so far, this chunk's included (written where the template
    /// has the usage's holes).
    pub completion_tokens: usize,
}

impl FrameTemplate {
    /// A template from the bytes around the two holes.
    pub fn new(head: Vec<u8>, mid: Vec<u8>, tail: Vec<u8>) -> Self {
        FrameTemplate {
            head,
            mid,
            ids_mid: None,
            usage: None,
            tail,
        }
    }

    /// The template with the token ids' hole after the logprobs (`ids_mid` between them;
    /// the tail then follows the ids or the usage).
    pub fn with_ids(mut self, ids_mid: Vec<u8>) -> Self {
        self.ids_mid = Some(ids_mid);
        self
    }

    /// The template with the usage's holes after the logprobs or the ids.
    pub fn with_usage(mut self, usage: UsageHoles) -> Self {
        self.usage = Some(usage);
        self
    }

    /// Whether the chunks carry their token ids.
    pub fn has_ids(&self) -> bool {
        self.ids_mid.is_some()
    }

    /// Appends the frame of `values` to `out`: the text's literal, the logprobs, and where
    /// the template has their holes the token ids (`[1,2]`, as pydantic writes a list of
    /// ints) and the usage's total and completion tokens.
    pub fn render(&self, out: &mut Vec<u8>, values: &FrameValues<'_>) {
        out.extend_from_slice(&self.head);
        push_str_literal(out, values.text);
        out.extend_from_slice(&self.mid);
        out.extend_from_slice(values.logprobs.unwrap_or(b"null"));
        if let Some(ids_mid) = &self.ids_mid {
            out.extend_from_slice(ids_mid);
            push_int_array(out, values.ids);
        }
        if let Some(usage) = &self.usage {
            let total = usage.prompt_tokens + values.completion_tokens;
            out.extend_from_slice(&usage.before_total);
            out.extend_from_slice(total.to_string().as_bytes());
            out.extend_from_slice(&usage.before_completion);
            out.extend_from_slice(values.completion_tokens.to_string().as_bytes());
        }
        out.extend_from_slice(&self.tail);
    }
}

/// Appends `v` as pydantic writes a float in JSON: Ryu's shortest round-trip digits
/// (a tie between two shortest candidates goes to the even one, where Rust's own
/// formatting rounds up), in positional notation while the decimal exponent is from -5 to
/// 15 (`0.000012`, `9999.0`, always with a fraction), otherwise in scientific notation
/// with a signed exponent (`1e-7`, `1.5e+16`); NaN and infinities as `null`.
pub fn push_float(out: &mut Vec<u8>, v: f64) {
    if !v.is_finite() {
        out.extend_from_slice(b"null");
        return;
    }
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(v).as_bytes();
    match text.iter().position(|&b| b == b'e') {
        // Ryu writes a positive exponent without its sign.
        Some(e) if text.get(e + 1) != Some(&b'-') => {
            out.extend_from_slice(&text[..=e]);
            out.push(b'+');
            out.extend_from_slice(&text[e + 1..]);
        }
        _ => out.extend_from_slice(text),
    }
}

/// One logprob candidate of a position as the completions API shows it: its token's
/// string and its logprob.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate<'a> {
    pub token: &'a str,
    pub logprob: f64,
}

/// One sampled position: the sampled token, and the candidates shown (in order; the
/// position's dict, so the sampled token is among them).
#[derive(Clone, Debug, PartialEq)]
pub struct Position<'a> {
    pub sampled: Candidate<'a>,
    pub top: Vec<Candidate<'a>>,
}

/// Appends the `logprobs` object of a chat completion chunk over `positions` (vLLM
/// 0.34.0's `ChatCompletionLogProbs`): `content`, one entry per position with the sampled
/// token's `token`, `logprob` and UTF-8 `bytes`, and `top_logprobs`, the candidates shown
/// (a list: a token string may show twice), each with the same three fields.
pub fn push_chat_logprobs(out: &mut Vec<u8>, positions: &[Position<'_>]) {
    out.extend_from_slice(b"{\"content\":[");
    for (i, p) in positions.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'{');
        push_chat_fields(out, &p.sampled);
        out.extend_from_slice(b",\"top_logprobs\":[");
        for (j, c) in p.top.iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            out.push(b'{');
            push_chat_fields(out, c);
            out.push(b'}');
        }
        out.extend_from_slice(b"]}");
    }
    out.extend_from_slice(b"]}");
}

/// A chat logprob's `token`, `logprob` (clamped) and `bytes` fields, unbraced.
fn push_chat_fields(out: &mut Vec<u8>, c: &Candidate<'_>) {
    out.extend_from_slice(b"\"token\":");
    push_str_literal(out, c.token);
    out.extend_from_slice(b",\"logprob\":");
    push_float(out, clamped(c.logprob));
    out.extend_from_slice(b",\"bytes\":");
    push_int_array(out, c.token.bytes());
}

/// Appends `values` as a JSON array of integers, as pydantic writes one (`[1,2]`).
fn push_int_array<T: ToString>(out: &mut Vec<u8>, values: impl IntoIterator<Item = T>) {
    out.push(b'[');
    for (i, value) in values.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(value.to_string().as_bytes());
    }
    out.push(b']');
}

/// A logprob as the completions API clamps it (`max(lp, -9999.0)`: NaN stays NaN, as
/// Python's `max` keeps its first argument when nothing compares greater).
fn clamped(logprob: f64) -> f64 {
    if logprob.is_nan() {
        logprob
    } else {
        logprob.max(-9999.0)
    }
}

/// Appends the `logprobs` object of a completions chunk over `positions` (vLLM 0.34.0's
/// `CompletionLogProbs`: `text_offset`, `token_logprobs`, `tokens`, `top_logprobs`, in that
/// order). `text_offset` is where the first token's text starts in the stream's text (in
/// code points); it is left where the next chunk's first token starts.
pub fn push_completion_logprobs(
    out: &mut Vec<u8>,
    positions: &[Position<'_>],
    text_offset: &mut usize,
) {
    out.extend_from_slice(b"{\"text_offset\":[");
    let mut offset = *text_offset;
    for (i, p) in positions.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(offset.to_string().as_bytes());
        offset += p.sampled.token.chars().count();
    }
    if !positions.is_empty() {
        *text_offset = offset;
    }
    out.extend_from_slice(b"],\"token_logprobs\":[");
    for (i, p) in positions.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_float(out, clamped(p.sampled.logprob));
    }
    out.extend_from_slice(b"],\"tokens\":[");
    for (i, p) in positions.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_str_literal(out, p.sampled.token);
    }
    out.extend_from_slice(b"],\"top_logprobs\":[");
    for (i, p) in positions.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // A dict by token string: a string seen again keeps its place, takes the value.
        let mut shown: Vec<(&str, f64)> = Vec::with_capacity(p.top.len());
        for c in &p.top {
            match shown.iter_mut().find(|(t, _)| *t == c.token) {
                Some(entry) => entry.1 = c.logprob,
                None => shown.push((c.token, c.logprob)),
            }
        }
        out.push(b'{');
        for (j, (token, logprob)) in shown.into_iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            push_str_literal(out, token);
            out.push(b':');
            push_float(out, clamped(logprob));
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
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
    use super::{
        http_chunk, push_chat_logprobs, push_completion_logprobs, push_float, push_str_literal,
        Candidate, FrameTemplate, FrameValues, Position, UsageHoles,
    };

    #[test]
    fn chat_logprobs_object() {
        let c = |token, logprob| Candidate { token, logprob };
        let positions = [
            Position {
                sampled: c(" é", -0.5),
                top: vec![c(" é", -0.5), c("x", -1.0e-7), c("x", f64::NEG_INFINITY)],
            },
            Position {
                sampled: c("\"", -20000.0),
                top: vec![],
            },
        ];
        let mut out = Vec::new();
        push_chat_logprobs(&mut out, &positions);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"content\":[{\"token\":\" é\",\"logprob\":-0.5,\"bytes\":[32,195,169],\
             \"top_logprobs\":[{\"token\":\" é\",\"logprob\":-0.5,\"bytes\":[32,195,169]},\
             {\"token\":\"x\",\"logprob\":-1e-7,\"bytes\":[120]},\
             {\"token\":\"x\",\"logprob\":-9999.0,\"bytes\":[120]}]},\
             {\"token\":\"\\\"\",\"logprob\":-9999.0,\"bytes\":[34],\"top_logprobs\":[]}]}"
        );
        let mut empty = Vec::new();
        push_chat_logprobs(&mut empty, &[]);
        assert_eq!(empty, b"{\"content\":[]}");
    }

    fn values<'a>(text: &'a str, logprobs: Option<&'a [u8]>, ids: &'a [i64]) -> FrameValues<'a> {
        FrameValues {
            text,
            logprobs,
            ids,
            completion_tokens: 0,
        }
    }

    #[test]
    fn a_frame_is_head_literal_mid_logprobs_tail() {
        let t = FrameTemplate::new(
            b"data: {\"t\":".to_vec(),
            b",\"l\":".to_vec(),
            b"}\n\n".to_vec(),
        );
        assert!(!t.has_ids());
        let mut out = Vec::new();
        // Without their holes, the ids and the usage are not written.
        t.render(&mut out, &values("a\"b", None, &[7]));
        t.render(&mut out, &values("", Some(b"[1]"), &[]));
        assert_eq!(
            out,
            b"data: {\"t\":\"a\\\"b\",\"l\":null}\n\ndata: {\"t\":\"\",\"l\":[1]}\n\n"
        );
    }

    #[test]
    fn a_frame_with_ids_writes_them_after_the_logprobs() {
        let t = FrameTemplate::new(
            b"data: {\"t\":".to_vec(),
            b",\"l\":".to_vec(),
            b"}\n\n".to_vec(),
        )
        .with_ids(b",\"ids\":".to_vec());
        assert!(t.has_ids());
        let mut out = Vec::new();
        t.render(&mut out, &values("x", None, &[5, -1, 151643]));
        t.render(&mut out, &values("", Some(b"{}"), &[]));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "data: {\"t\":\"x\",\"l\":null,\"ids\":[5,-1,151643]}\n\n\
             data: {\"t\":\"\",\"l\":{},\"ids\":[]}\n\n"
        );
    }

    #[test]
    fn a_frame_with_usage_writes_the_total_and_the_completion_tokens_last() {
        let usage = UsageHoles {
            before_total: b"],\"u\":{\"p\":5,\"t\":".to_vec(),
            before_completion: b",\"c\":".to_vec(),
            prompt_tokens: 5,
        };
        let with_ids = FrameTemplate::new(
            b"data: {\"c\":[{\"t\":".to_vec(),
            b",\"l\":".to_vec(),
            b"}}\n\n".to_vec(),
        )
        .with_ids(b",\"ids\":".to_vec())
        .with_usage(usage);
        let mut out = Vec::new();
        let mut v = values("x", None, &[9, 10]);
        v.completion_tokens = 12;
        with_ids.render(&mut out, &v);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "data: {\"c\":[{\"t\":\"x\",\"l\":null,\"ids\":[9,10]],\"u\":{\"p\":5,\"t\":17,\"c\":12}}\n\n"
        );
        let plain = FrameTemplate::new(b"{".to_vec(), b",".to_vec(), b"}".to_vec()).with_usage(
            UsageHoles {
                before_total: b";".to_vec(),
                before_completion: b";".to_vec(),
                prompt_tokens: 0,
            },
        );
        let mut out = Vec::new();
        v.completion_tokens = 1;
        plain.render(&mut out, &v);
        assert_eq!(out, b"{\"x\",null;1;1}");
    }

    fn float(v: f64) -> String {
        let mut out = Vec::new();
        push_float(&mut out, v);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn floats_as_pydantic_writes_them() {
        // Each pair as pydantic 2 (vLLM 0.34.0's) dumps the float to JSON.
        let cases: &[(f64, &str)] = &[
            (-1.2e-05, "-0.000012"),
            (-0.0001, "-0.0001"),
            (-0.001, "-0.001"),
            (-9999.0, "-9999.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (-3.0, "-3.0"),
            (-1e-7, "-1e-7"),
            (-123456789.0, "-123456789.0"),
            (-1.5e16, "-1.5e+16"),
            (-1e16, "-1e+16"),
            (-9.999e15, "-9999000000000000.0"),
            (-0.1, "-0.1"),
            (-2.5, "-2.5"),
            (-1e-5, "-0.00001"),
            (-0.00012, "-0.00012"),
            (-1.0000000000000002e-06, "-1.0000000000000002e-6"),
            // An f32 logprob (-2.77494049072265625 exactly), between two 17-digit
            // candidates: the even one.
            (
                f64::from(f32::from_bits(0xc031_98a0)),
                "-2.7749404907226562",
            ),
            (f64::NAN, "null"),
            (f64::NEG_INFINITY, "null"),
        ];
        for &(v, want) in cases {
            assert_eq!(float(v), want, "{v:e}");
        }
    }

    #[test]
    fn completion_logprobs_object() {
        let c = |token, logprob| Candidate { token, logprob };
        let positions = [
            Position {
                sampled: c(" héllo", -0.5),
                // " a" twice: the dict keeps its first place and its last value.
                top: vec![
                    c(" héllo", -0.5),
                    c(" a", -1.0),
                    c(" a", -2.0),
                    c("\n", f64::NEG_INFINITY),
                ],
            },
            Position {
                sampled: c("!", -1e-7),
                top: vec![c("!", -1e-7)],
            },
        ];
        let mut out = Vec::new();
        let mut offset = 3;
        push_completion_logprobs(&mut out, &positions, &mut offset);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"text_offset\":[3,9],\"token_logprobs\":[-0.5,-1e-7],\"tokens\":[\" héllo\",\"!\"],\
             \"top_logprobs\":[{\" héllo\":-0.5,\" a\":-2.0,\"\\n\":-9999.0},{\"!\":-1e-7}]}"
        );
        assert_eq!(offset, 10);
        let mut empty = Vec::new();
        push_completion_logprobs(&mut empty, &[], &mut offset);
        assert_eq!(
            empty,
            b"{\"text_offset\":[],\"token_logprobs\":[],\"tokens\":[],\"top_logprobs\":[]}"
        );
        assert_eq!(offset, 10);
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
