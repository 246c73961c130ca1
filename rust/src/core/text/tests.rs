//! Unit tests of the text side, against what vLLM 0.25.1's Python gives for the same
//! inputs (worked out by hand from its code; the differential tests in `tests/` compare
//! with vLLM itself).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use super::candidates;
use super::chars;
use super::decoder::TextDecoder;
use super::output::{OutputText, StopRules};
use super::stops::{earliest_end, first_in_order, Cut, StopString};
use super::stream::{DecodeStream, StepNote};

fn stops(list: &[&str]) -> Vec<StopString> {
    list.iter()
        .map(|s| StopString::new((*s).to_owned()))
        .collect()
}

fn pieces(text: &mut OutputText, ids: &[i64], table: &[&str]) -> Option<usize> {
    text.update::<Infallible>(ids, false, |id| Ok(table[id as usize].to_owned()))
        .unwrap()
}

#[test]
fn find_from_counts_code_points_and_negative_starts() {
    let s = "héllo wörld";
    let n = s.chars().count();
    assert_eq!(chars::find_from(s, n, "wö", 0), Some(6));
    assert_eq!(chars::find_from(s, n, "wö", -5), Some(6));
    assert_eq!(chars::find_from(s, n, "wö", -4), None);
    assert_eq!(chars::find_from(s, n, "h", -100), Some(0));
    assert_eq!(chars::find_from(s, n, "", 11), Some(11));
    assert_eq!(chars::find_from(s, n, "", 12), None);
}

#[test]
fn first_stop_in_list_order_wins_and_cuts() {
    let text = "ab STOP cd END";
    let n = text.chars().count();
    // Both are in the window; the first listed wins even though it ends later.
    let found = first_in_order(text, n, n, &stops(&["END", "STOP"]), false);
    assert_eq!(found, Some((0, Cut::At(11))));
    let kept = first_in_order(text, n, n, &stops(&["END"]), true);
    assert_eq!(kept, Some((0, Cut::None)));
    let inside = first_in_order(text, n, n, &stops(&["STOP"]), true);
    assert_eq!(inside, Some((0, Cut::At(7))));
    // Only the window the new characters could complete is searched.
    assert_eq!(first_in_order(text, n, 1, &stops(&["STOP"]), false), None);
    assert_eq!(first_in_order(text, n, 0, &stops(&["END"]), false), None);
}

#[test]
fn stop_spanning_tokens_truncates_and_releases_hold_back() {
    let table = ["he", "llo", " wo", "rld", " X"];
    let rules = StopRules {
        stops: stops(&["o wor"]),
        min_tokens: 0,
        include_in_output: false,
        earliest: false,
    };
    let mut text = OutputText::new(rules);
    assert_eq!(pieces(&mut text, &[0, 1], &table), None);
    // "hello": 4 code points held back while unfinished.
    assert!(text.has_next_output(false));
    assert_eq!(text.next_output(false, true), "h");
    // Asked, not handed out: nothing new until more text comes.
    assert!(!text.has_next_output(false));
    assert!(text.has_next_output(true));
    assert_eq!(pieces(&mut text, &[2], &table), None);
    assert!(text.has_next_output(false));
    assert!(text.has_next_output(false));
    assert_eq!(text.next_output(false, true), "ell");
    assert_eq!(pieces(&mut text, &[3], &table), Some(0));
    assert_eq!(text.text(), "hell");
    assert!(!text.has_next_output(true));
    assert_eq!(text.next_output(true, true), "");
    assert_eq!(text.next_output(true, false), "hell");
}

#[test]
fn min_tokens_suppresses_early_stops() {
    let table = ["a", "b", "a", "b"];
    let rules = StopRules {
        stops: stops(&["ab"]),
        min_tokens: 2,
        include_in_output: true,
        earliest: false,
    };
    let mut text = OutputText::new(rules);
    assert_eq!(pieces(&mut text, &[0, 1], &table), None);
    assert_eq!(pieces(&mut text, &[2], &table), None);
    assert_eq!(pieces(&mut text, &[3], &table), Some(0));
    assert_eq!(text.text(), "abab");
}

#[test]
fn stop_terminated_last_token_is_counted_not_decoded() {
    let table = ["x", "<eos>"];
    let mut text = OutputText::new(StopRules::default());
    text.update::<Infallible>(&[0, 1], true, |id| Ok(table[id as usize].to_owned()))
        .unwrap();
    assert_eq!((text.text(), text.tokens()), ("x", 2));
    let rules = StopRules {
        stops: vec![],
        min_tokens: 0,
        include_in_output: true,
        earliest: false,
    };
    let mut kept = OutputText::new(rules);
    kept.update::<Infallible>(&[0, 1], true, |id| Ok(table[id as usize].to_owned()))
        .unwrap();
    assert_eq!(kept.text(), "x<eos>");
}

#[test]
fn cumulative_output_holds_back_by_code_points() {
    let rules = StopRules {
        stops: stops(&["ééé"]),
        min_tokens: 0,
        include_in_output: false,
        earliest: false,
    };
    let mut text = OutputText::new(rules);
    pieces(&mut text, &[0], &["añbçd"]);
    assert_eq!(text.next_output(false, false), "añb");
    assert_eq!(text.next_output(true, false), "añbçd");
}

#[test]
fn correction_uses_shortest_completing_context() {
    // Ids 0..=2 are the three bytes of "€" decoded alone (incomplete), 3 is "a".
    let bytes: [&[u8]; 4] = [b"\xe2", b"\x82", b"\xac", b"a"];
    let decode = |ids: &[u32]| -> Result<String, Infallible> {
        let raw: Vec<u8> = ids
            .iter()
            .flat_map(|&i| bytes[i as usize].iter().copied())
            .collect();
        Ok(String::from_utf8_lossy(&raw).into_owned())
    };
    let alone =
        |id: u32| -> Result<bool, Infallible> { Ok(candidates::incomplete(&decode(&[id])?)) };
    assert_eq!(
        candidates::correct(2, &[3, 0, 1], decode, alone).unwrap(),
        "€"
    );
    assert_eq!(candidates::correct(1, &[3, 0], decode, alone).unwrap(), "");
    assert_eq!(candidates::correct(2, &[], decode, alone).unwrap(), "");
}

const WORDS: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [
    {"id": 4, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 5, "content": "<t>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "[UNK]": 3, "<s>": 4, "<t>": 5},
            "unk_token": "[UNK]"}
}"#;

fn words() -> TextDecoder {
    TextDecoder::new(WORDS.parse().expect("test tokenizer"))
}

#[test]
fn stream_matches_whole_decode_and_restores_special_spacing() {
    let tok = words();
    let added: Arc<HashMap<u32, String>> = Arc::new(
        [(4, "<s>".to_owned()), (5, "<t>".to_owned())]
            .into_iter()
            .collect(),
    );
    let mut stream = DecodeStream::new(&[0], false, true, &added);
    let mut out = String::new();
    for id in [1, 2, 4, 5] {
        out.push_str(&stream.next(&tok, id).unwrap().0);
    }
    let whole = tok.decode(&[0, 1, 2, 4, 5], false).unwrap();
    assert_eq!(
        format!("{}{}", tok.decode(&[0], false).unwrap(), out),
        whole
    );
    // Without spaces between special tokens, the second of two specials is its content.
    let mut tight = DecodeStream::new(&[0], false, false, &added);
    tight.next(&tok, 4).unwrap();
    assert_eq!(tight.next(&tok, 5).unwrap().0, "<t>");
    let (text, note) = tight.next(&tok, -1).unwrap();
    assert_eq!((text.as_str(), note), ("", Some(StepNote::InvalidId(-1))));
}

/// A byte-level BPE over the 256 byte characters, with merges that put pieces of "é"
/// (bytes C3 A9) and "日" (E6 97 A5) in single tokens, and one special token.
fn byte_level() -> tokenizers::Tokenizer {
    use tokenizers::decoders::byte_level::ByteLevel;
    use tokenizers::models::bpe::BPE;
    use tokenizers::AddedToken;

    let alphabet: Vec<char> = {
        let mut chars: Vec<char> = (b'!'..=b'~')
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .map(char::from)
            .collect();
        chars.extend((0..68).map(|n| char::from_u32(256 + n).unwrap()));
        chars
    };
    let mut vocab: std::collections::HashMap<String, u32> = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let merges = vec![
        ("Ã".to_owned(), "©".to_owned()),
        ("æ".to_owned(), "Ĺ".to_owned()),
    ];
    for (a, b) in &merges {
        let id = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), id);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(
            vocab
                .into_iter()
                .collect::<tokenizers::models::bpe::Vocab>(),
            merges,
        )
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default()));
    tok.with_decoder(Some(ByteLevel::default()));
    let _ = tok.add_special_tokens([AddedToken::from("<s>", true)]);
    tok
}

#[test]
fn byte_table_decodes_as_the_crate_and_streams_the_same_text() {
    let tok = byte_level();
    let fast = TextDecoder::new(tok.clone());
    assert!(fast.uses_byte_table());
    let text = "aé 日本 <s>x";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    for skip in [false, true] {
        assert_eq!(
            fast.decode(&ids, skip).unwrap(),
            tok.decode(&ids, skip).unwrap()
        );
        // Every cut of the ids, the incomplete characters at the cut included.
        for cut in 0..ids.len() {
            assert_eq!(
                fast.decode(&ids[..cut], skip).unwrap(),
                tok.decode(&ids[..cut], skip).unwrap()
            );
        }
        let none: Arc<HashMap<u32, String>> = Arc::default();
        let mut stream = DecodeStream::new(&ids[..2], skip, true, &none);
        let streamed: String = ids[2..]
            .iter()
            .map(|&id| stream.next(&fast, id.into()).unwrap().0)
            .collect();
        let whole = tok.decode(&ids, skip).unwrap();
        let head = tok.decode(&ids[..2], skip).unwrap();
        assert_eq!(format!("{head}{streamed}"), whole);
    }
}

#[test]
fn earliest_ending_stop_wins_under_the_0_33_0_rule() {
    let text = "ab STOP cd END";
    let n = text.chars().count();
    // Both in the window: the one that ends first wins, whatever the list order.
    let found = earliest_end(text, n, n, &stops(&["END", "STOP"]), false);
    assert_eq!(found, Some((1, Cut::At(3))));
    let kept = earliest_end(text, n, n, &stops(&["END", "STOP"]), true);
    assert_eq!(kept, Some((1, Cut::At(7))));
    // Ties go to the list order; a kept stop string that ends the text cuts nothing.
    assert_eq!(
        earliest_end("xEND", 4, 4, &stops(&["ND", "END"]), true),
        Some((0, Cut::None))
    );
    assert_eq!(earliest_end(text, n, 1, &stops(&["STOP"]), false), None);
}

#[test]
fn earliest_rule_drops_the_ids_after_the_stop() {
    let table = ["ab", "S", "TOP", "cd", "EF"];
    let rules = StopRules {
        stops: stops(&["STOP", "cdE"]),
        min_tokens: 0,
        include_in_output: false,
        earliest: true,
    };
    let mut text = OutputText::new(rules);
    // Five ids in one step: the stop completes with the third; the last two go.
    assert_eq!(pieces(&mut text, &[0, 1, 2, 3, 4], &table), Some(0));
    assert_eq!((text.text(), text.tokens(), text.dropped()), ("ab", 3, 2));
    // min_tokens counts ids: no stop may end within the first 4.
    let rules = StopRules {
        stops: stops(&["STOP"]),
        min_tokens: 4,
        include_in_output: true,
        earliest: true,
    };
    let mut late = OutputText::new(rules);
    assert_eq!(pieces(&mut late, &[0, 1, 2], &table), None);
    assert_eq!(pieces(&mut late, &[3, 1, 2], &table), Some(0));
    assert_eq!(
        (late.text(), late.tokens(), late.dropped()),
        ("abSTOPcdSTOP", 6, 0)
    );
}
