//! Tests of deeply nested free-form values: the depth bound ([`MAX_DEPTH`], chosen to
//! read every frame vLLM 0.25.1 reads), its error (depth and path), and that the walk's
//! stack use does not grow with the nesting (measured, and on a thread with a small
//! stack). Frames are written byte by byte: a recursive writer or a recursive `Drop` of
//! a deep [`Tree`] would itself need the stack these tests keep small.

use std::hint::black_box;

use super::error::{ArrayKind, DecodeError, DecodeResult, ErrorKind, PATH_SHOWN};
use super::schema::{
    decode_outputs, ArrayRef, Builder, MessageSlots, OutputSlots, Scratch, UtilitySlots, MAX_DEPTH,
};
use super::tree::{MessageTree, Tree, TreeBuilder};
use super::wire::{MessageField as MF, OutputField as OF};

/// Stack given to the threads that decode at the bound (the walk needs a few KiB at
/// any depth; see `stack_use_does_not_grow_with_depth`).
const SMALL_STACK: usize = 64 * 1024;

/// What a deep value is made of.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// `[[...[]]]`
    Arrays,
    /// `{"k": {"k": ... {}}}`
    Maps,
    /// `{(((...(),),),): 1}`: the depth is in a key (arrays used as map keys).
    KeyTuples,
    /// `[{"k": [{"k": ...}]}]`, alternating.
    Mixed,
}

const SHAPES: [Shape; 4] = [Shape::Arrays, Shape::Maps, Shape::KeyTuples, Shape::Mixed];

/// A value of `levels` nested containers (`levels >= 2`), as msgpack.
fn deep(shape: Shape, levels: usize) -> Vec<u8> {
    assert!(levels >= 2);
    let mut out = Vec::new();
    match shape {
        Shape::Arrays => {
            out.extend(std::iter::repeat_n(0x91, levels - 1));
            out.push(0x90);
        }
        Shape::Maps => {
            for _ in 0..levels - 1 {
                out.extend([0x81, 0xa1, b'k']);
            }
            out.push(0x80);
        }
        Shape::KeyTuples => {
            out.push(0x81);
            out.extend(std::iter::repeat_n(0x91, levels - 2));
            out.extend([0x90, 0x01]);
        }
        Shape::Mixed => {
            for level in 0..levels - 1 {
                if level % 2 == 0 {
                    out.push(0x91);
                } else {
                    out.extend([0x81, 0xa1, b'k']);
                }
            }
            out.push(if levels % 2 == 1 { 0x90 } else { 0x80 });
        }
    }
    out
}

/// `[0, [], {"deep": value}]`: the value in `scheduler_stats`.
fn in_stats(value: &[u8]) -> Vec<u8> {
    let mut out = vec![0x93, 0x00, 0x90, 0x81, 0xa4];
    out.extend(b"deep");
    out.extend(value);
    out
}

/// `[0, [["r", [], nil x 6, {"k": value}]]]`: the value in an output's
/// `kv_transfer_params`.
fn in_kv_transfer_params(value: &[u8]) -> Vec<u8> {
    let mut out = vec![0x92, 0x00, 0x91, 0x99, 0xa1, b'r', 0x90];
    out.extend([0xc0; 6]);
    out.extend([0x81, 0xa1, b'k']);
    out.extend(value);
    out
}

/// `[0, [], nil, 0.0, [1, nil, [nil, value]]]`: a utility result.
fn in_utility_result(value: &[u8]) -> Vec<u8> {
    let mut out = vec![0x95, 0x00, 0x90, 0xc0, 0xcb];
    out.extend([0; 8]);
    out.extend([0x93, 0x01, 0xc0, 0x92, 0xc0]);
    out.extend(value);
    out
}

fn decode(payload: &[u8]) -> Result<MessageTree, DecodeError> {
    let frames = [payload];
    let mut b = TreeBuilder::new(&frames);
    decode_outputs(&frames, &mut b, &mut Scratch::default()).map(Tree::into_message)
}

/// Counts the containers along a chain of one-element containers, taking the tree
/// apart level by level (so that no deep `Drop` runs).
fn levels_of(mut t: Tree) -> usize {
    let mut levels = 0;
    loop {
        let mut items = match t {
            Tree::List(items) | Tree::Tuple(items) => items,
            Tree::Dict(entries) => match entries.into_iter().next() {
                None => Vec::new(),
                // The depth is in the key when the key is a tuple.
                Some((key @ Tree::Tuple(_), _)) => vec![key],
                Some((_, value)) => vec![value],
            },
            _ => return levels,
        };
        levels += 1;
        match items.pop() {
            Some(inner) if items.is_empty() => t = inner,
            None => return levels,
            Some(_) => panic!("not a one-element chain"),
        }
    }
}

/// The one value of a message's `scheduler_stats` / first `kv_transfer_params` /
/// utility result, whichever is set.
fn the_value(mut m: MessageTree) -> Tree {
    let dict_value = |t: Tree| match t {
        Tree::Dict(entries) => entries.into_iter().next().expect("one entry").1,
        other => panic!("not a dict: {other:?}"),
    };
    // (taken out, not cloned: a deep value's clone would recurse)
    let take = |t: &mut Tree| std::mem::replace(t, Tree::None);
    if m[MF::SchedulerStats] != Tree::None {
        return dict_value(take(&mut m[MF::SchedulerStats]));
    }
    if let Some(mut out) = m.outputs.pop() {
        return dict_value(take(&mut out[OF::KvTransferParams]));
    }
    match take(&mut m[MF::UtilityOutput]) {
        Tree::UtilityOutput { result, .. } => match *result {
            Tree::UtilityResult(value) => *value,
            other => panic!("not a utility result: {other:?}"),
        },
        other => panic!("no value: {other:?}"),
    }
}

type Frame = fn(&[u8]) -> Vec<u8>;
const PLACES: [(Frame, &str); 3] = [
    (in_stats, "scheduler_stats[\"deep\"]"),
    (
        in_kv_transfer_params,
        "outputs[0].kv_transfer_params[\"k\"]",
    ),
    (in_utility_result, "utility_output.result[1]"),
];

/// Every shape in every place decodes at [`MAX_DEPTH`] levels and fails one level
/// deeper, with the depth and the path in the error.
fn check_the_bound() {
    for shape in SHAPES {
        for (place, path) in PLACES {
            let m = decode(&place(&deep(shape, MAX_DEPTH))).unwrap();
            assert_eq!(levels_of(the_value(m)), MAX_DEPTH, "{shape:?} at {path}");

            let err = decode(&place(&deep(shape, MAX_DEPTH + 1))).unwrap_err();
            assert_eq!(
                err.kind(),
                &ErrorKind::TooDeep {
                    depth: MAX_DEPTH + 1,
                    limit: MAX_DEPTH
                },
                "{shape:?} at {path}"
            );
            let text = err.to_string();
            assert!(text.starts_with(path), "{text}");
            assert!(
                text.ends_with(&format!(
                    ": value nested {} levels deep, deeper than the {MAX_DEPTH} allowed",
                    MAX_DEPTH + 1
                )),
                "{text}"
            );
        }
    }
}

#[test]
fn vllm_depth_decodes_and_one_more_level_fails() {
    // vLLM 0.25.1 reads kv_transfer_params values up to ~994 levels, utility results
    // up to ~995 (Python's default recursion limit, less the levels around them).
    const _: () = assert!(MAX_DEPTH >= 995);
    check_the_bound();
}

#[test]
fn the_bound_holds_on_a_thread_with_a_small_stack() {
    std::thread::Builder::new()
        .stack_size(SMALL_STACK)
        .spawn(check_the_bound)
        .unwrap()
        .join()
        .expect("decoding at the bound on a small stack");
}

#[test]
fn far_past_the_bound_fails_cleanly_on_a_small_stack() {
    std::thread::Builder::new()
        .stack_size(SMALL_STACK)
        .spawn(|| {
            for shape in SHAPES {
                let err = decode(&in_stats(&deep(shape, 1_000_000))).unwrap_err();
                assert_eq!(
                    err.kind(),
                    &ErrorKind::TooDeep {
                        depth: MAX_DEPTH + 1,
                        limit: MAX_DEPTH
                    }
                );
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn a_deep_error_path_is_shortened_around_a_count() {
    let err = decode(&in_stats(&deep(Shape::Arrays, MAX_DEPTH + 1))).unwrap_err();
    // scheduler_stats, "deep", then one index per enclosing list.
    let segments = 2 + MAX_DEPTH;
    let head = PATH_SHOWN / 2;
    let tail = PATH_SHOWN / 4;
    let expected = format!(
        "scheduler_stats[\"deep\"]{}…({} more)…{}",
        "[0]".repeat(head - 2),
        segments - head - tail,
        "[0]".repeat(tail),
    );
    assert_eq!(err.path_string(), expected);
    // A path of PATH_SHOWN segments is shown whole.
    let mut bad = deep(Shape::Arrays, PATH_SHOWN - 2);
    bad.pop();
    bad.push(0x91);
    bad.push(0xc1); // not msgpack, inside the innermost list
    let err = decode(&in_stats(&bad)).unwrap_err();
    assert_eq!(
        err.path_string(),
        format!("scheduler_stats[\"deep\"]{}", "[0]".repeat(PATH_SHOWN - 2))
    );
}

#[test]
fn errors_inside_nested_values_name_their_place() {
    let cases: [(&[u8], &str, ErrorKind); 6] = [
        // {"a": [1, {"b": [nil, <bad utf8>]}]}
        (
            b"\x81\xa1a\x92\x01\x81\xa1b\x92\xc0\xa1\xff",
            "[\"a\"][1][\"b\"][1]",
            ErrorKind::InvalidUtf8,
        ),
        // {"a": {[1, <bad utf8>]: 2}}: in a key's tuple
        (
            b"\x81\xa1a\x81\x92\x01\xa1\xff\x02",
            "[\"a\"]<key of entry 0>[1]",
            ErrorKind::InvalidUtf8,
        ),
        // {"a": [{{}: 1}]}: a map as a key
        (
            b"\x81\xa1a\x91\x81\x80\x01",
            "[\"a\"][0]<key of entry 0>",
            ErrorKind::UnhashableKey,
        ),
        // {"a": {[1, {}]: 2}}: a map inside a key's tuple
        (
            b"\x81\xa1a\x81\x92\x01\x80\x02",
            "[\"a\"]<key of entry 0>[1]",
            ErrorKind::UnhashableKey,
        ),
        // {"a": {5: nil, 7: ext -1}}: in the value of an int key, second entry
        (
            b"\x81\xa1a\x82\x05\xc0\x07\xd4\xff\x00",
            "[\"a\"][\"7\"]",
            ErrorKind::UnknownExt { code: -1 },
        ),
        // {"a": {nil: [1, ext -1]}}: a key that is no str or int shows its entry
        (
            b"\x81\xa1a\x81\xc0\x92\x01\xd4\xff\x00",
            "[\"a\"][0][1]",
            ErrorKind::UnknownExt { code: -1 },
        ),
    ];
    for (value, path, kind) in cases {
        // The value is the whole map of scheduler_stats here.
        let mut payload = vec![0x93, 0x00, 0x90];
        payload.extend(value);
        let err = decode(&payload).unwrap_err();
        assert_eq!(err.kind(), &kind, "{err}");
        assert_eq!(err.path_string(), format!("scheduler_stats{path}"), "{err}");
    }
}

#[test]
fn values_after_a_deep_one_decode_normally() {
    // Two deep values in one message, then a plain field: the walk's stack of open
    // containers is empty again after each value.
    let mut payload = vec![0x92, 0x00, 0x91, 0x9a, 0xa1, b'r', 0x90];
    payload.extend([0xc0; 6]);
    payload.extend([0x81, 0xa1, b'k']);
    payload.extend(deep(Shape::Mixed, MAX_DEPTH));
    payload.extend([0x81, 0xa1, b't', 0xa1, b'v']); // trace_headers {"t": "v"}
    let m = decode(&payload).unwrap();
    let mut out = m.outputs.into_iter().next().unwrap();
    assert_eq!(
        out[OF::TraceHeaders],
        Tree::Dict(vec![(Tree::Str("t".into()), Tree::Str("v".into()))])
    );
    let kv = std::mem::replace(&mut out[OF::KvTransferParams], Tree::None);
    let Tree::Dict(entries) = kv else { panic!() };
    let value = entries.into_iter().next().unwrap().1;
    assert_eq!(levels_of(value), MAX_DEPTH);
}

/// Lowest stack address seen by the builder: a probe of how deep the walk's calls go.
struct Probe<'f> {
    tree: TreeBuilder<'f>,
    lowest: usize,
}

impl Probe<'_> {
    #[inline(never)]
    fn mark(&mut self) {
        let here = black_box(0u8);
        self.lowest = self.lowest.min(&here as *const u8 as usize);
    }
}

impl Builder for Probe<'_> {
    type Obj = Tree;

    fn none(&mut self) -> Tree {
        self.mark();
        self.tree.none()
    }
    fn bool(&mut self, v: bool) -> Tree {
        self.tree.bool(v)
    }
    fn int(&mut self, v: i128) -> DecodeResult<Tree> {
        self.mark();
        self.tree.int(v)
    }
    fn float(&mut self, v: f64) -> DecodeResult<Tree> {
        self.tree.float(v)
    }
    fn str(&mut self, v: &str) -> DecodeResult<Tree> {
        self.mark();
        self.tree.str(v)
    }
    fn key_str(&mut self, v: &str) -> DecodeResult<Tree> {
        self.mark();
        self.tree.key_str(v)
    }
    fn bytes(&mut self, v: &[u8]) -> DecodeResult<Tree> {
        self.tree.bytes(v)
    }
    fn list(&mut self, len: usize) -> DecodeResult<Tree> {
        self.mark();
        self.tree.list(len)
    }
    fn list_set(&mut self, list: &mut Tree, index: usize, item: Tree) {
        self.mark();
        self.tree.list_set(list, index, item)
    }
    fn tuple_from_list(&mut self, list: Tree) -> DecodeResult<Tree> {
        self.mark();
        self.tree.tuple_from_list(list)
    }
    fn dict(&mut self) -> DecodeResult<Tree> {
        self.mark();
        self.tree.dict()
    }
    fn dict_set(&mut self, dict: &mut Tree, key: Tree, value: Tree) -> DecodeResult<()> {
        self.mark();
        // (not TreeBuilder's: comparing deep keys for duplicates recurses)
        if let Tree::Dict(entries) = dict {
            entries.push((key, value));
        }
        Ok(())
    }
    fn set(&mut self) -> DecodeResult<Tree> {
        self.tree.set()
    }
    fn set_add(&mut self, set: &mut Tree, item: Tree) -> DecodeResult<()> {
        self.tree.set_add(set, item)
    }
    fn request_id(&mut self, raw: &[u8]) -> DecodeResult<Tree> {
        self.tree.request_id(raw)
    }
    fn event(&mut self, kind: u8, timestamp: f64) -> DecodeResult<Tree> {
        self.tree.event(kind, timestamp)
    }
    fn dtype_itemsize(&mut self, kind: ArrayKind, dtype: &str) -> DecodeResult<usize> {
        self.tree.dtype_itemsize(kind, dtype)
    }
    fn array(&mut self, array: &ArrayRef<'_>) -> DecodeResult<Tree> {
        self.tree.array(array)
    }
    fn logprobs(&mut self, kind: ArrayKind, fields: &mut [Option<Tree>]) -> DecodeResult<Tree> {
        self.tree.logprobs(kind, fields)
    }
    fn utility_result(&mut self, value: Tree) -> DecodeResult<Tree> {
        self.tree.utility_result(value)
    }
    fn utility_output(&mut self, fields: &mut UtilitySlots<Tree>) -> DecodeResult<Tree> {
        self.tree.utility_output(fields)
    }
    fn token_ids(&mut self, ids: &[i128]) -> DecodeResult<Tree> {
        self.tree.token_ids(ids)
    }
    fn finish_reason(&mut self, code: u8) -> DecodeResult<Tree> {
        self.tree.finish_reason(code)
    }
    fn output(&mut self, fields: &mut OutputSlots<Tree>) -> DecodeResult<Tree> {
        self.tree.output(fields)
    }
    fn message(&mut self, fields: &mut MessageSlots<Tree>) -> DecodeResult<Tree> {
        self.tree.message(fields)
    }
}

/// Bytes of stack below `decode_outputs`'s caller that the walk used for `payload`.
#[inline(never)]
fn stack_used(payload: &[u8]) -> (usize, Result<MessageTree, DecodeError>) {
    let top = black_box(0u8);
    let top = &top as *const u8 as usize;
    let frames = [payload];
    let mut probe = Probe {
        tree: TreeBuilder::new(&frames),
        lowest: usize::MAX,
    };
    let r = decode_outputs(&frames, &mut probe, &mut Scratch::default()).map(Tree::into_message);
    assert!(probe.lowest < top, "the probe ran");
    (top - probe.lowest, r)
}

#[test]
fn stack_use_does_not_grow_with_depth() {
    for shape in SHAPES {
        for (place, _) in PLACES {
            // (4 levels: every kind of container and key of the shape)
            let (shallow, m) = stack_used(&place(&deep(shape, 4)));
            assert_eq!(levels_of(the_value(m.unwrap())), 4);
            let (at_bound, m) = stack_used(&place(&deep(shape, MAX_DEPTH)));
            assert_eq!(levels_of(the_value(m.unwrap())), MAX_DEPTH);
            let (past, m) = stack_used(&place(&deep(shape, MAX_DEPTH + 1)));
            assert!(m.is_err());
            println!("{shape:?}: stack used {shallow} B at 4 levels, {at_bound} B at {MAX_DEPTH}, {past} B past it");
            assert_eq!(at_bound, shallow, "{shape:?}");
            // (failing, the walk stops before the deepest call of a success)
            assert!(past <= shallow, "{shape:?}");
            assert!(at_bound < SMALL_STACK / 2, "{shape:?}: {at_bound} B");
        }
    }
}
