//! Tests of the schema walk through [`TreeBuilder`]: every field, defaults, extra
//! fields, every error variant and where it is reported. Frames are written with the
//! small msgpack writer below, so each test shows the exact bytes it feeds.

use super::error::{ArrayKind, DecodeError, ErrorKind, Kind};
use super::schema::{
    decode_outputs, decode_outputs_as, decode_outputs_for, Builder, Scratch, MAX_DEPTH, MAX_DIMS,
};
use super::tree::{MessageTree, OutputTree, Tree, TreeBuilder};
use super::wire::{
    layout, layout_from_names, wire_fields, Layout, LayoutError, LayoutNames, LayoutRef,
    MessageField as MF, OutputField, OutputField as OF, Protocol, StructLayout, Version,
    WireStruct, CURRENT, LAYOUT_0_25_1, LAYOUT_0_33_0, LAYOUT_0_34_0, SKIPPED, V0_33_0,
};

/// A msgpack value to write.
#[derive(Clone, Debug)]
enum V {
    Nil,
    B(bool),
    I(i128),
    F(f64),
    F32(f32),
    S(String),
    Raw(Vec<u8>),
    Bin(Vec<u8>),
    Ext(i8, Vec<u8>),
    /// Bytes written as they are (a value already encoded, in a chosen form).
    Pre(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn s(v: &str) -> V {
    V::S(v.to_owned())
}
fn i(v: i128) -> V {
    V::I(v)
}
fn a(v: Vec<V>) -> V {
    V::A(v)
}

fn put_len(
    out: &mut Vec<u8>,
    len: usize,
    fix: Option<(u8, usize)>,
    m8: Option<u8>,
    m16: u8,
    m32: u8,
) {
    match (fix, m8) {
        (Some((base, max)), _) if len <= max => out.push(base | len as u8),
        (_, Some(m)) if len <= 0xff => out.extend([m, len as u8]),
        _ if len <= 0xffff => {
            out.push(m16);
            out.extend((len as u16).to_be_bytes());
        }
        _ => {
            out.push(m32);
            out.extend((len as u32).to_be_bytes());
        }
    }
}

fn enc_into(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::B(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        V::I(n) => {
            let n = *n;
            if (0..=0x7f).contains(&n) {
                out.push(n as u8);
            } else if (-32..0).contains(&n) {
                out.push(n as i8 as u8);
            } else if n > i64::MAX as i128 {
                out.push(0xcf);
                out.extend((n as u64).to_be_bytes());
            } else if (0..=0xffff).contains(&n) {
                out.push(0xcd);
                out.extend((n as u16).to_be_bytes());
            } else if n >= 0 && n <= u32::MAX as i128 {
                out.push(0xce);
                out.extend((n as u32).to_be_bytes());
            } else {
                out.push(0xd3);
                out.extend((n as i64).to_be_bytes());
            }
        }
        V::F(f) => {
            out.push(0xcb);
            out.extend(f.to_be_bytes());
        }
        V::F32(f) => {
            out.push(0xca);
            out.extend(f.to_be_bytes());
        }
        V::S(st) => {
            put_len(out, st.len(), Some((0xa0, 31)), Some(0xd9), 0xda, 0xdb);
            out.extend(st.as_bytes());
        }
        V::Raw(bytes) => {
            put_len(out, bytes.len(), Some((0xa0, 31)), Some(0xd9), 0xda, 0xdb);
            out.extend(bytes);
        }
        V::Pre(bytes) => out.extend(bytes),
        V::Bin(bytes) => {
            put_len(out, bytes.len(), None, Some(0xc4), 0xc5, 0xc6);
            out.extend(bytes);
        }
        V::Ext(code, bytes) => {
            match bytes.len() {
                1 => out.push(0xd4),
                2 => out.push(0xd5),
                4 => out.push(0xd6),
                8 => out.push(0xd7),
                16 => out.push(0xd8),
                n => put_len(out, n, None, Some(0xc7), 0xc8, 0xc9),
            }
            out.push(*code as u8);
            out.extend(bytes);
        }
        V::A(items) => {
            put_len(out, items.len(), Some((0x90, 15)), None, 0xdc, 0xdd);
            for item in items {
                enc_into(item, out);
            }
        }
        V::M(entries) => {
            put_len(out, entries.len(), Some((0x80, 15)), None, 0xde, 0xdf);
            for (k, v) in entries {
                enc_into(k, out);
                enc_into(v, out);
            }
        }
    }
}

fn enc(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc_into(v, &mut out);
    out
}

fn decode_frames(frames: &[&[u8]]) -> Result<MessageTree, DecodeError> {
    let mut b = TreeBuilder::new(frames);
    decode_outputs(frames, &mut b, &mut Scratch::default()).map(Tree::into_message)
}

fn decode(msg: &V) -> Result<MessageTree, DecodeError> {
    let payload = enc(msg);
    decode_frames(&[&payload])
}

fn decode_err(msg: &V) -> DecodeError {
    decode(msg).expect_err("expected a decoding error")
}

/// A message around the given outputs: `[0, outputs, nil, 1.5]`.
fn msg(outputs: Vec<V>) -> V {
    a(vec![i(0), a(outputs), V::Nil, V::F(1.5)])
}

/// An output with `fields` after request_id and new_token_ids.
fn out(id: &str, tokens: &[i128], fields: Vec<V>) -> V {
    let mut f = vec![s(id), a(tokens.iter().map(|&t| i(t)).collect())];
    f.extend(fields);
    a(f)
}

/// An output with field `index` set to `value` (nil before it, default-length).
fn out_with(index: usize, value: V) -> V {
    let mut f = vec![V::Nil; 10];
    f[index - 2] = value;
    f.push(i(0));
    out("r", &[1], f)
}

fn only_output(m: MessageTree) -> OutputTree {
    assert_eq!(m.outputs.len(), 1);
    m.outputs.into_iter().next().unwrap()
}

fn arr_inline(dtype: &str, shape: &[i128], data: &[u8]) -> V {
    a(vec![
        s(dtype),
        a(shape.iter().map(|&d| i(d)).collect()),
        V::Ext(3, data.to_vec()),
    ])
}

#[test]
fn minimal_message_gets_defaults() {
    let m = decode(&a(vec![])).unwrap();
    assert_eq!(m[MF::EngineIndex], Tree::Int(0));
    assert!(m.outputs.is_empty());
    assert_eq!(m[MF::SchedulerStats], Tree::None);
    assert_eq!(m[MF::Timestamp], Tree::Float(0.0));
    assert_eq!(m[MF::UtilityOutput], Tree::None);
    assert_eq!(m[MF::FinishedRequests], Tree::None);
    assert_eq!(m[MF::WaveComplete], Tree::None);
    assert_eq!(m[MF::StartWave], Tree::None);
}

#[test]
fn typical_decode_step() {
    let m = decode(&msg(vec![
        out("cmpl-a-0", &[151_000], vec![]),
        out(
            "cmpl-b-0",
            &[7, 8],
            vec![
                V::Nil,
                V::Nil,
                V::Nil,
                i(1),
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
                i(0),
            ],
        ),
    ]))
    .unwrap();
    assert_eq!(m[MF::Timestamp], Tree::Float(1.5));
    assert_eq!(m.outputs.len(), 2);
    let o = &m.outputs[0];
    assert_eq!(o[OF::RequestId], Tree::Str("cmpl-a-0".into()));
    assert_eq!(o[OF::NewTokenIds], Tree::ints(&[151_000]));
    assert_eq!(o[OF::FinishReason], Tree::None);
    assert_eq!(o[OF::NumNansInLogits], Tree::Int(0));
    assert_eq!(o[OF::NewLogprobs], Tree::None);
    let o = &m.outputs[1];
    assert_eq!(o[OF::NewTokenIds], Tree::ints(&[7, 8]));
    assert_eq!(o[OF::FinishReason], Tree::Int(1));
}

#[test]
fn every_output_field() {
    let lp = a(vec![
        arr_inline("<i4", &[1, 2], &[1, 0, 0, 0, 2, 0, 0, 0]),
        arr_inline("<f4", &[1, 2], &[0; 8]),
        arr_inline("<i4", &[1], &[0; 4]),
        a(vec![i(0), i(1)]),
    ]);
    let plp = a(vec![
        arr_inline("int64", &[1, 1], &[9; 8]),
        arr_inline("bfloat16", &[1, 1], &[1, 2]),
        arr_inline("int64", &[1], &[0; 8]),
    ]);
    let fields = vec![
        lp,
        plp,
        arr_inline("float16", &[2], &[0, 60, 0, 64]),
        i(0),
        s("</s>"),
        a(vec![
            V::M(vec![(s("type"), i(1)), (s("timestamp"), V::F(2.5))]),
            V::M(vec![
                (s("timestamp"), i(3)),
                (s("type"), i(3)),
                (s("extra"), a(vec![])),
            ]),
        ]),
        V::M(vec![(s("remote"), a(vec![i(1), s("x")]))]),
        V::M(vec![(s("traceparent"), s("00-ab"))]),
        V::M(vec![(s("num_cached_tokens"), i(12))]),
        arr_inline("|b1", &[3], &[1, 0, 1]),
        i(4),
    ];
    let o = only_output(decode(&msg(vec![out("ünï-çødé-🙂", &[], fields)])).unwrap());
    assert_eq!(o[OF::RequestId], Tree::Str("ünï-çødé-🙂".into()));
    assert_eq!(o[OF::NewTokenIds], Tree::ints(&[]));
    match &o[OF::NewLogprobs] {
        Tree::Logprobs {
            kind,
            arrays,
            cu_num_generated_tokens,
            later,
        } => {
            assert_eq!(*kind, ArrayKind::Ndarray);
            assert!(later.is_empty());
            assert_eq!(arrays.len(), 3);
            match &arrays[0] {
                Tree::Array {
                    dtype,
                    shape,
                    data,
                    frame,
                    ..
                } => {
                    assert_eq!(dtype, "<i4");
                    assert_eq!(shape, &vec![1, 2]);
                    assert_eq!(data, &vec![1, 0, 0, 0, 2, 0, 0, 0]);
                    assert_eq!(*frame, 0);
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(
                **cu_num_generated_tokens,
                Tree::List(vec![Tree::Int(0), Tree::Int(1)])
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        &o[OF::NewPromptLogprobsTensors],
        Tree::Logprobs { kind: ArrayKind::Tensor, cu_num_generated_tokens, .. }
            if **cu_num_generated_tokens == Tree::None
    ));
    assert!(matches!(
        &o[OF::PoolingOutput],
        Tree::Array {
            kind: ArrayKind::Tensor,
            ..
        }
    ));
    assert_eq!(o[OF::FinishReason], Tree::Int(0));
    assert_eq!(o[OF::StopReason], Tree::Str("</s>".into()));
    assert_eq!(
        o[OF::Events],
        Tree::List(vec![
            Tree::Event {
                kind: 1,
                timestamp: 2.5
            },
            Tree::Event {
                kind: 3,
                timestamp: 3.0
            },
        ])
    );
    assert_eq!(
        o[OF::KvTransferParams],
        Tree::Dict(vec![(
            Tree::Str("remote".into()),
            Tree::List(vec![Tree::Int(1), Tree::Str("x".into())])
        )])
    );
    assert_eq!(
        o[OF::TraceHeaders],
        Tree::Dict(vec![(
            Tree::Str("traceparent".into()),
            Tree::Str("00-ab".into())
        )])
    );
    assert!(matches!(&o[OF::PrefillStats], Tree::Dict(e) if e.len() == 1));
    assert!(matches!(
        &o[OF::RoutedExperts],
        Tree::Array {
            kind: ArrayKind::Ndarray,
            ..
        }
    ));
    assert_eq!(o[OF::NumNansInLogits], Tree::Int(4));
}

#[test]
fn stop_reason_int_and_finish_reasons() {
    for code in 0..=4 {
        let o = only_output(decode(&msg(vec![out_with(5, i(code))])).unwrap());
        assert_eq!(o[OF::FinishReason], Tree::Int(code));
    }
    let o = only_output(decode(&msg(vec![out_with(6, i(128_001))])).unwrap());
    assert_eq!(o[OF::StopReason], Tree::Int(128_001));
}

#[test]
fn every_message_field_and_call_ids() {
    for call_id in [0i128, 1, (1 << 63) + 5, u64::MAX as i128, -1] {
        let m = decode(&a(vec![
            i(3),
            a(vec![]),
            V::M(vec![(s("num_running_reqs"), i(2)), (s("kv"), V::F32(0.5))]),
            V::F(12.25),
            a(vec![
                i(call_id),
                V::Nil,
                a(vec![V::Nil, a(vec![s("scale"), i(1)])]),
            ]),
            a(vec![s("x"), s("y"), s("x")]),
            i(7),
            i(8),
        ]))
        .unwrap();
        assert_eq!(m[MF::EngineIndex], Tree::Int(3));
        assert_eq!(
            m[MF::SchedulerStats],
            Tree::Dict(vec![
                (Tree::Str("num_running_reqs".into()), Tree::Int(2)),
                (Tree::Str("kv".into()), Tree::Float(0.5)),
            ])
        );
        assert_eq!(m[MF::Timestamp], Tree::Float(12.25));
        assert_eq!(
            m[MF::UtilityOutput],
            Tree::UtilityOutput {
                call_id,
                failure_message: Box::new(Tree::None),
                result: Box::new(Tree::UtilityResult(Box::new(Tree::List(vec![
                    Tree::Str("scale".into()),
                    Tree::Int(1)
                ])))),
            }
        );
        assert_eq!(
            m[MF::FinishedRequests],
            Tree::Set(vec![Tree::Str("x".into()), Tree::Str("y".into())])
        );
        assert_eq!(m[MF::WaveComplete], Tree::Int(7));
        assert_eq!(m[MF::StartWave], Tree::Int(8));
    }
}

#[test]
fn utility_failure_and_short_utility() {
    let m = decode(&a(vec![
        i(0),
        a(vec![]),
        V::Nil,
        i(1),
        a(vec![i(9), s("Call to x method failed: boom")]),
    ]))
    .unwrap();
    assert_eq!(
        m[MF::Timestamp],
        Tree::Float(1.0),
        "int timestamps widen to float"
    );
    assert_eq!(
        m[MF::UtilityOutput],
        Tree::UtilityOutput {
            call_id: 9,
            failure_message: Box::new(Tree::Str("Call to x method failed: boom".into())),
            result: Box::new(Tree::None),
        }
    );
    let m = decode(&a(vec![i(0), a(vec![]), V::Nil, i(1), a(vec![i(4)])])).unwrap();
    assert!(matches!(
        m[MF::UtilityOutput],
        Tree::UtilityOutput { call_id: 4, .. }
    ));
}

#[test]
fn extra_trailing_fields_are_skipped_everywhere() {
    let extra = || {
        vec![
            V::M(vec![(s("new"), a(vec![V::M(vec![]), V::Bin(vec![1])]))]),
            V::Ext(42, vec![1, 2, 3]),
            s("\u{ff}"),
        ]
    };
    let mut fields = vec![a(vec![
        arr_inline("<i4", &[0, 6], &[]),
        arr_inline("<f4", &[0, 6], &[]),
        arr_inline("<i4", &[0], &[]),
        V::Nil,
    ]
    .into_iter()
    .chain(extra())
    .collect())];
    fields.extend(vec![V::Nil; 9]);
    fields.push(i(0));
    fields.extend(extra());
    let mut top = vec![
        i(1),
        a(vec![out("r", &[1], fields)]),
        V::Nil,
        V::F(0.0),
        a(vec![i(1), V::Nil, V::Nil]
            .into_iter()
            .chain(extra())
            .collect()),
        V::Nil,
        V::Nil,
        V::Nil,
    ];
    top.extend(extra());
    let m = decode(&a(top)).unwrap();
    assert_eq!(m[MF::EngineIndex], Tree::Int(1));
    assert!(matches!(
        &m.outputs[0][OF::NewLogprobs],
        Tree::Logprobs { arrays, .. } if arrays.len() == 3
    ));
    assert!(matches!(
        m[MF::UtilityOutput],
        Tree::UtilityOutput { call_id: 1, .. }
    ));
}

#[test]
fn short_arrays_stop_at_any_field() {
    // An output with only the two required fields, and a message cut after each field.
    let full = [
        i(2),
        a(vec![out("r", &[1], vec![])]),
        V::Nil,
        V::F(3.0),
        V::Nil,
        a(vec![s("r")]),
        i(1),
        i(2),
    ];
    for len in 0..=full.len() {
        let m = decode(&a(full[..len].to_vec())).unwrap();
        assert_eq!(m[MF::EngineIndex], Tree::Int(if len > 0 { 2 } else { 0 }));
        assert_eq!(m.outputs.len(), usize::from(len > 1));
        assert_eq!(
            m[MF::StartWave],
            if len > 7 { Tree::Int(2) } else { Tree::None }
        );
    }
    let mut out_fields = vec![V::Nil; 10];
    out_fields.push(i(5));
    for len in 0..=out_fields.len() {
        let o = only_output(decode(&msg(vec![out("r", &[], out_fields[..len].to_vec())])).unwrap());
        assert_eq!(
            o[OF::NumNansInLogits],
            Tree::Int(if len == 11 { 5 } else { 0 })
        );
    }
}

#[test]
fn aux_frames_and_inline_data() {
    let aux1 = vec![0u8; 256];
    let aux2: Vec<u8> = (0..=255u8).cycle().take(1024).collect();
    let payload = enc(&msg(vec![out_with(
        11,
        a(vec![s("<i4"), a(vec![i(16), i(16)]), i(2)]),
    )]));
    let frames: Vec<&[u8]> = vec![&payload, &aux1, &aux2];
    let o = only_output(decode_frames(&frames).unwrap());
    match o[OF::RoutedExperts].clone() {
        Tree::Array {
            frame, data, shape, ..
        } => {
            assert_eq!(frame, 2);
            assert_eq!(data, aux2);
            assert_eq!(shape, vec![16, 16]);
        }
        other => panic!("{other:?}"),
    }
    // Zero-size and zero-dimensional arrays.
    for (shape, data) in [
        (vec![], vec![7u8, 0, 0, 0]),
        (vec![0, 5], vec![]),
        (vec![3, 0], vec![]),
    ] {
        let o = only_output(
            decode(&msg(vec![out_with(11, arr_inline("<i4", &shape, &data))])).unwrap(),
        );
        assert!(matches!(o[OF::RoutedExperts].clone(), Tree::Array { data: d, .. } if d == data));
    }
}

/// `[dtype, shape, data]` inline in the longest forms: array16, str8 dtype, array16 of
/// uint16 dims, ext16 data.
fn arr_inline_long(dtype: &str, shape: &[i128], data: &[u8]) -> V {
    let mut b = vec![0xdc, 0, 3, 0xd9, dtype.len() as u8];
    b.extend(dtype.as_bytes());
    b.extend([0xdc, 0, shape.len() as u8]);
    for &d in shape {
        b.push(0xcd);
        b.extend((d as u16).to_be_bytes());
    }
    b.push(0xc8);
    b.extend((data.len() as u16).to_be_bytes());
    b.push(3);
    b.extend(data);
    V::Pre(b)
}

#[test]
fn small_inline_arrays_read_alike_in_every_form() {
    // The short forms (fixstr dtype, fixint dims, fixext or ext8 data: what encoders
    // write for logprobs rows, and what the raw-view fast path reads) and the longest
    // forms build the same arrays: logprobs rows, 0-d, empty, 4-d and 5-d arrays, every
    // fixext size, dims over 127.
    let cases: Vec<(&str, Vec<i128>, usize)> = vec![
        ("<i4", vec![1, 6], 4),
        ("<f4", vec![1, 6], 4),
        ("<i8", vec![1], 8),
        ("|b1", vec![1], 1),
        ("<i2", vec![1], 2),
        ("<f4", vec![1], 4),
        ("<f8", vec![2], 8),
        ("<i4", vec![], 4),
        ("<i4", vec![0, 5], 4),
        ("<f8", vec![2, 2, 2, 2], 8),
        ("<i2", vec![1, 1, 1, 1, 2], 2),
        ("|u1", vec![200], 1),
    ];
    for (dtype, shape, itemsize) in cases {
        let n: i128 = shape.iter().product();
        let data: Vec<u8> = (0..n as usize * itemsize).map(|b| b as u8 ^ 0x5a).collect();
        let lists = |arr: V| a(vec![arr.clone(), arr.clone(), arr, V::Nil]);
        let short = decode(&msg(vec![out_with(
            2,
            lists(arr_inline(dtype, &shape, &data)),
        )]));
        let long = decode(&msg(vec![out_with(
            2,
            lists(arr_inline_long(dtype, &shape, &data)),
        )]));
        let short = short.unwrap();
        assert_eq!(short, long.unwrap(), "{dtype} {shape:?}");
        match only_output(short)[OF::NewLogprobs].clone() {
            Tree::Logprobs { arrays, .. } => match &arrays[1] {
                Tree::Array {
                    dtype: d,
                    shape: s,
                    data: got,
                    frame,
                    ..
                } => {
                    assert_eq!((d.as_str(), *frame), (dtype, 0));
                    assert_eq!(s, &shape.iter().map(|&x| x as usize).collect::<Vec<_>>());
                    assert_eq!(got, &data);
                }
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }
    // A non-ASCII dtype string is read, and unknown.
    let err = decode_err(&msg(vec![out_with(11, arr_inline("<é4", &[1], &[0; 4]))]));
    assert_eq!(err.path_string(), "outputs[0].routed_experts.dtype");
}

fn assert_err(msg: &V, path: &str, kind: ErrorKind) {
    let err = decode_err(msg);
    assert_eq!(err.kind(), &kind, "{err}");
    assert_eq!(err.path_string(), path, "{err}");
}

#[test]
fn wrong_type_says_what_and_where() {
    let outputs: Vec<V> = (0..4)
        .map(|k| {
            if k == 3 {
                a(vec![s("r3"), a(vec![i(1), i(2), s("x")])])
            } else {
                out("r", &[1], vec![])
            }
        })
        .collect();
    let err = decode_err(&msg(outputs));
    assert_eq!(
        err.to_string(),
        "outputs[3].new_token_ids[2]: expected int, got str"
    );
    assert_err(
        &a(vec![s("x")]),
        "engine_index",
        ErrorKind::Type {
            expected: "int",
            got: Kind::Str,
        },
    );
    assert_err(
        &a(vec![i(0), a(vec![]), V::Nil, s("t")]),
        "timestamp",
        ErrorKind::Type {
            expected: "float",
            got: Kind::Str,
        },
    );
    assert_err(
        &a(vec![
            i(0),
            a(vec![]),
            V::Nil,
            V::F(0.0),
            V::Nil,
            V::Nil,
            V::B(true),
        ]),
        "wave_complete",
        ErrorKind::Type {
            expected: "int | nil",
            got: Kind::Bool,
        },
    );
    assert_err(
        &msg(vec![out_with(6, V::F(1.0))]),
        "outputs[0].stop_reason",
        ErrorKind::Type {
            expected: "int | str | nil",
            got: Kind::Float,
        },
    );
    assert_err(
        &msg(vec![out_with(9, V::M(vec![(s("k"), i(1))]))]),
        "outputs[0].trace_headers[\"k\"]",
        ErrorKind::Type {
            expected: "str",
            got: Kind::Int,
        },
    );
    assert_err(
        &msg(vec![out_with(8, V::M(vec![(i(1), i(1))]))]),
        "outputs[0].kv_transfer_params<key of entry 0>",
        ErrorKind::Type {
            expected: "str",
            got: Kind::Int,
        },
    );
    assert_err(
        &a(vec![i(0), s("outputs")]),
        "outputs",
        ErrorKind::Type {
            expected: "array",
            got: Kind::Str,
        },
    );
    assert_err(
        &i(5),
        "",
        ErrorKind::Type {
            expected: "array (EngineCoreOutputs)",
            got: Kind::Int,
        },
    );
    let mut fields = vec![V::Nil; 10];
    fields.push(V::Nil); // num_nans_in_logits is not optional
    let err = decode_err(&msg(vec![out("r", &[], fields)]));
    assert_eq!(err.path_string(), "outputs[0].num_nans_in_logits");
    assert!(err
        .to_string()
        .starts_with("outputs[0].num_nans_in_logits: expected int, got nil"));
}

#[test]
fn too_short_and_wrong_length() {
    assert_err(
        &msg(vec![a(vec![s("r")])]),
        "outputs[0]",
        ErrorKind::TooShort { min: 2, got: 1 },
    );
    assert_err(
        &a(vec![i(0), a(vec![]), V::Nil, V::F(0.0), a(vec![])]),
        "utility_output",
        ErrorKind::TooShort { min: 1, got: 0 },
    );
    assert_err(
        &msg(vec![out_with(2, a(vec![V::Nil, V::Nil]))]),
        "outputs[0].new_logprobs",
        ErrorKind::TooShort { min: 3, got: 2 },
    );
    assert_err(
        &msg(vec![out_with(
            4,
            a(vec![s("float32"), a(vec![]), V::Ext(3, vec![0; 4]), V::Nil]),
        )]),
        "outputs[0].pooling_output",
        ErrorKind::WrongLength {
            expected: 3,
            got: 4,
        },
    );
    assert_err(
        &a(vec![
            i(0),
            a(vec![]),
            V::Nil,
            V::F(0.0),
            a(vec![i(1), V::Nil, a(vec![V::Nil])]),
        ]),
        "utility_output.result",
        ErrorKind::WrongLength {
            expected: 2,
            got: 1,
        },
    );
}

#[test]
fn not_msgpack_truncated_trailing() {
    let err = decode_frames(&[b"\xc1"]).unwrap_err();
    assert!(matches!(
        err.kind(),
        ErrorKind::InvalidMarker {
            byte: 0xc1,
            offset: 0
        }
    ));
    let err = decode_frames(&[b""]).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Truncated { offset: 0 }));
    let err = decode_frames(&[]).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::EmptyMessage);
    let mut bytes = enc(&msg(vec![out("r", &[1], vec![])]));
    bytes.push(0);
    let err = decode_frames(&[&bytes]).unwrap_err();
    assert!(matches!(
        err.kind(),
        ErrorKind::TrailingBytes { count: 1, .. }
    ));
    bytes.pop();
    // Every strict prefix fails (no partial message).
    for cut in 0..bytes.len() {
        let err = decode_frames(&[&bytes[..cut]]).unwrap_err();
        assert!(
            matches!(err.kind(), ErrorKind::Truncated { .. }),
            "cut {cut}: {err}"
        );
    }
    // Truncation inside an output reports the output's path.
    let bytes = enc(&a(vec![i(0), a(vec![out("r", &[1, 2], vec![])])]));
    let err = decode_frames(&[&bytes[..bytes.len() - 1]]).unwrap_err();
    assert!(err.path_string().starts_with("outputs[0]"), "{err}");
}

#[test]
fn int_ranges_enums_and_utf8() {
    assert_err(
        &msg(vec![out_with(5, i(5))]),
        "outputs[0].finish_reason",
        ErrorKind::InvalidEnum {
            what: "FinishReason",
            value: 5,
        },
    );
    assert_err(
        &msg(vec![out_with(5, i(-1))]),
        "outputs[0].finish_reason",
        ErrorKind::InvalidEnum {
            what: "FinishReason",
            value: -1,
        },
    );
    assert_err(
        &msg(vec![out_with(
            7,
            a(vec![V::M(vec![
                (s("type"), i(0)),
                (s("timestamp"), V::F(0.0)),
            ])]),
        )]),
        "outputs[0].events[0].type",
        ErrorKind::InvalidEnum {
            what: "EngineCoreEventType",
            value: 0,
        },
    );
    assert_err(
        &msg(vec![a(vec![V::Raw(vec![0x66, 0xff]), a(vec![])])]),
        "outputs[0].request_id",
        ErrorKind::InvalidUtf8,
    );
    assert_err(
        &a(vec![
            i(0),
            a(vec![]),
            V::Nil,
            V::F(0.0),
            V::Nil,
            a(vec![s("ok"), V::Raw(vec![0xc0])]),
        ]),
        "finished_requests[1]",
        ErrorKind::InvalidUtf8,
    );
    assert_err(
        &msg(vec![out_with(
            8,
            V::M(vec![(s("k"), a(vec![V::Raw(vec![0xe2, 0x82])]))]),
        )]),
        "outputs[0].kv_transfer_params[\"k\"][0]",
        ErrorKind::InvalidUtf8,
    );
    // u64 and i64 extremes decode exactly.
    let o = only_output(
        decode(&msg(vec![out(
            "r",
            &[u64::MAX as i128, i64::MIN as i128, -1],
            vec![],
        )]))
        .unwrap(),
    );
    assert_eq!(
        o[OF::NewTokenIds],
        Tree::ints(&[u64::MAX as i128, i64::MIN as i128, -1])
    );
}

#[test]
fn events_need_both_keys() {
    assert_err(
        &msg(vec![out_with(7, a(vec![V::M(vec![(s("type"), i(1))])]))]),
        "outputs[0].events[0]",
        ErrorKind::MissingKey { key: "timestamp" },
    );
    assert_err(
        &msg(vec![out_with(
            7,
            a(vec![V::M(vec![(s("timestamp"), i(1))])]),
        )]),
        "outputs[0].events[0]",
        ErrorKind::MissingKey { key: "type" },
    );
    assert_err(
        &msg(vec![out_with(7, a(vec![V::M(vec![(i(1), i(1))])]))]),
        "outputs[0].events[0]<key of entry 0>",
        ErrorKind::NonStrKey { got: Kind::Int },
    );
    assert_err(
        &msg(vec![out_with(7, a(vec![a(vec![i(1), V::F(0.0)])]))]),
        "outputs[0].events[0]",
        ErrorKind::Type {
            expected: "map (EngineCoreEvent)",
            got: Kind::Array,
        },
    );
}

#[test]
fn nesting_limit() {
    let nest = |depth: usize| {
        let mut v = i(1);
        for _ in 0..depth {
            v = a(vec![v]);
        }
        v
    };
    let stats = |v: V| a(vec![i(0), a(vec![]), V::M(vec![(s("deep"), v)])]);
    // MAX_DEPTH containers inside the dict value are fine; one more is not.
    decode(&stats(nest(MAX_DEPTH))).unwrap();
    let err = decode_err(&stats(nest(MAX_DEPTH + 1)));
    assert_eq!(
        err.kind(),
        &ErrorKind::TooDeep {
            depth: MAX_DEPTH + 1,
            limit: MAX_DEPTH
        }
    );
    assert!(
        err.path_string()
            .starts_with("scheduler_stats[\"deep\"][0][0]"),
        "{err}"
    );
    // Deep map nesting and deep keys too.
    let mut m = i(1);
    for _ in 0..=MAX_DEPTH {
        m = V::M(vec![(s("k"), m)]);
    }
    assert_eq!(
        decode_err(&stats(m)).kind(),
        &ErrorKind::TooDeep {
            depth: MAX_DEPTH + 1,
            limit: MAX_DEPTH
        }
    );
    // Deeply nested junk in an ignored trailing field is skipped without recursion.
    // (Written by hand: the test writer itself recurses.)
    let mut bytes = enc(&a(vec![
        i(0),
        a(vec![]),
        V::Nil,
        V::F(0.0),
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
    ]));
    bytes[0] = 0x99;
    bytes.pop();
    bytes.extend(std::iter::repeat_n(0x91u8, 50_000));
    bytes.push(0xc0);
    let m = decode_frames(&[&bytes]).unwrap();
    assert_eq!(m[MF::EngineIndex], Tree::Int(0));
}

#[test]
fn generic_values() {
    let value = V::M(vec![
        (s("nil"), V::Nil),
        (s("t"), V::B(true)),
        (s("neg"), i(-5)),
        (s("big"), i(u64::MAX as i128)),
        (s("f32"), V::F32(0.25)),
        (s("bin"), V::Bin(vec![1, 2])),
        (s("ext3"), V::Ext(3, vec![9])),
        (
            s("nested"),
            a(vec![V::M(vec![(i(1), s("one"))]), a(vec![])]),
        ),
        (s("dup"), i(1)),
        (s("dup"), i(2)),
    ]);
    let m = decode(&a(vec![i(0), a(vec![]), value])).unwrap();
    let Tree::Dict(entries) = m[MF::SchedulerStats].clone() else {
        panic!()
    };
    let get = |k: &str| {
        entries
            .iter()
            .find(|(key, _)| *key == Tree::Str(k.into()))
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(get("nil"), Tree::None);
    assert_eq!(get("t"), Tree::Bool(true));
    assert_eq!(get("neg"), Tree::Int(-5));
    assert_eq!(get("big"), Tree::Int(u64::MAX as i128));
    assert_eq!(get("f32"), Tree::Float(0.25));
    assert_eq!(get("bin"), Tree::Bytes(vec![1, 2]));
    assert_eq!(get("ext3"), Tree::Bytes(vec![9]));
    assert_eq!(get("dup"), Tree::Int(2), "later duplicate wins");
    assert_eq!(
        get("nested"),
        Tree::List(vec![
            Tree::Dict(vec![(Tree::Int(1), Tree::Str("one".into()))]),
            Tree::List(vec![])
        ])
    );
    // Free-form map keys: arrays become tuples, maps are unhashable.
    let result = |v: V| {
        a(vec![
            i(0),
            a(vec![]),
            V::Nil,
            V::F(0.0),
            a(vec![i(1), V::Nil, a(vec![V::Nil, v])]),
        ])
    };
    let m = decode(&result(V::M(vec![(
        a(vec![i(1), a(vec![s("x")])]),
        V::Nil,
    )])))
    .unwrap();
    let Tree::UtilityOutput {
        result: decoded, ..
    } = m[MF::UtilityOutput].clone()
    else {
        panic!()
    };
    assert_eq!(
        *decoded,
        Tree::UtilityResult(Box::new(Tree::Dict(vec![(
            Tree::Tuple(vec![Tree::Int(1), Tree::Tuple(vec![Tree::Str("x".into())])]),
            Tree::None
        )])))
    );
    let err = decode_err(&result(V::M(vec![(V::M(vec![]), V::Nil)])));
    assert_eq!(err.kind(), &ErrorKind::UnhashableKey);
    assert_eq!(
        err.path_string(),
        "utility_output.result[1]<key of entry 0>"
    );
    let err = decode_err(&result(V::Ext(-1, vec![0; 4])));
    assert_eq!(err.kind(), &ErrorKind::UnknownExt { code: -1 });
}

#[test]
fn array_errors() {
    let ro = |v: V| msg(vec![out_with(11, v)]);
    let path = "outputs[0].routed_experts";
    assert_err(
        &ro(a(vec![s("<i4"), a(vec![i(1)]), V::Ext(5, vec![0; 4])])),
        &format!("{path}.data"),
        ErrorKind::UnknownExt { code: 5 },
    );
    assert_err(
        &ro(a(vec![s("<i4"), a(vec![i(1)]), s("data")])),
        &format!("{path}.data"),
        ErrorKind::BadArrayData { got: Kind::Str },
    );
    for index in [0i128, 1, -1, 1 << 40] {
        assert_err(
            &ro(a(vec![s("<i4"), a(vec![i(64)]), i(index)])),
            &format!("{path}.data"),
            ErrorKind::AuxIndexOutOfRange {
                index,
                aux_frames: 0,
            },
        );
    }
    assert_err(
        &ro(arr_inline("<x4", &[1], &[0; 4])),
        &format!("{path}.dtype"),
        ErrorKind::UnknownDtype {
            kind: ArrayKind::Ndarray,
            dtype: "<x4".into(),
        },
    );
    assert_err(
        &ro(arr_inline("|O", &[1], &[0; 8])),
        &format!("{path}.dtype"),
        ErrorKind::UnknownDtype {
            kind: ArrayKind::Ndarray,
            dtype: "|O".into(),
        },
    );
    assert_err(
        &msg(vec![out_with(4, arr_inline("float33", &[1], &[0; 4]))]),
        "outputs[0].pooling_output.dtype",
        ErrorKind::UnknownDtype {
            kind: ArrayKind::Tensor,
            dtype: "float33".into(),
        },
    );
    assert_err(
        &ro(arr_inline("<i4", &[2], &[0; 4])),
        path,
        ErrorKind::ByteLength { needed: 8, got: 4 },
    );
    assert_err(
        &ro(arr_inline("<i4", &[-1], &[])),
        &format!("{path}.shape[0]"),
        ErrorKind::NegativeDim { dim: -1 },
    );
    let dims = vec![1i128; MAX_DIMS + 1];
    assert_err(
        &ro(arr_inline("<i4", &dims, &[0; 4])),
        &format!("{path}.shape"),
        ErrorKind::TooManyDims {
            ndim: MAX_DIMS + 1,
            limit: MAX_DIMS,
        },
    );
    assert_err(
        &ro(arr_inline("<i4", &[1 << 62, 1 << 62, 0], &[])),
        &format!("{path}.shape"),
        ErrorKind::ShapeOverflow,
    );
    assert_err(
        &ro(arr_inline("<i4", &[u64::MAX as i128], &[])),
        &format!("{path}.shape[0]"),
        ErrorKind::IntOutOfRange {
            value: u64::MAX as i128,
            min: 0,
            max: i64::MAX as i128,
        },
    );
    assert_err(
        &ro(a(vec![i(4), a(vec![]), V::Ext(3, vec![])])),
        &format!("{path}.dtype"),
        ErrorKind::Type {
            expected: "str",
            got: Kind::Int,
        },
    );
    // Inside logprobs the path names the array.
    assert_err(
        &msg(vec![out_with(
            2,
            a(vec![
                arr_inline("<i4", &[1], &[0; 4]),
                arr_inline("<f4", &[1], &[0; 3]),
                arr_inline("<i4", &[1], &[0; 4]),
            ]),
        )]),
        "outputs[0].new_logprobs.logprobs",
        ErrorKind::ByteLength { needed: 4, got: 3 },
    );
}

/// A builder that refuses one kind of value, to check that builder errors get a path.
struct Refusing<'f>(TreeBuilder<'f>);

impl Builder for Refusing<'_> {
    type Obj = Tree;
    fn none(&mut self) -> Tree {
        self.0.none()
    }
    fn bool(&mut self, v: bool) -> Tree {
        self.0.bool(v)
    }
    fn int(&mut self, v: i128) -> Result<Tree, DecodeError> {
        self.0.int(v)
    }
    fn float(&mut self, v: f64) -> Result<Tree, DecodeError> {
        self.0.float(v)
    }
    fn str(&mut self, v: &str) -> Result<Tree, DecodeError> {
        self.0.str(v)
    }
    fn bytes(&mut self, v: &[u8]) -> Result<Tree, DecodeError> {
        self.0.bytes(v)
    }
    fn list(&mut self, len: usize) -> Result<Tree, DecodeError> {
        self.0.list(len)
    }
    fn list_set(&mut self, list: &mut Tree, index: usize, item: Tree) {
        self.0.list_set(list, index, item)
    }
    fn tuple_from_list(&mut self, list: Tree) -> Result<Tree, DecodeError> {
        self.0.tuple_from_list(list)
    }
    fn dict(&mut self) -> Result<Tree, DecodeError> {
        self.0.dict()
    }
    fn dict_set(&mut self, d: &mut Tree, k: Tree, v: Tree) -> Result<(), DecodeError> {
        self.0.dict_set(d, k, v)
    }
    fn set(&mut self) -> Result<Tree, DecodeError> {
        self.0.set()
    }
    fn set_add(&mut self, set: &mut Tree, item: Tree) -> Result<(), DecodeError> {
        self.0.set_add(set, item)
    }
    fn request_id(&mut self, raw: &[u8]) -> Result<Tree, DecodeError> {
        if raw == b"refuse" {
            return Err(DecodeError::new(ErrorKind::Foreign));
        }
        self.0.request_id(raw)
    }
    fn event(&mut self, kind: u8, timestamp: f64) -> Result<Tree, DecodeError> {
        self.0.event(kind, timestamp)
    }
    fn dtype_itemsize(&mut self, kind: ArrayKind, dtype: &str) -> Result<usize, DecodeError> {
        self.0.dtype_itemsize(kind, dtype)
    }
    fn array(&mut self, array: &super::schema::ArrayRef<'_>) -> Result<Tree, DecodeError> {
        Err(DecodeError::new(ErrorKind::Rejected(format!(
            "no {}",
            array.dtype
        ))))
    }
    fn token_ids(&mut self, ids: &[i128]) -> Result<Tree, DecodeError> {
        self.0.token_ids(ids)
    }
    fn finish_reason(&mut self, code: u8) -> Result<Tree, DecodeError> {
        self.0.finish_reason(code)
    }
    fn logprobs(&mut self, k: ArrayKind, fields: &mut [Option<Tree>]) -> Result<Tree, DecodeError> {
        self.0.logprobs(k, fields)
    }
    fn utility_result(&mut self, value: Tree) -> Result<Tree, DecodeError> {
        self.0.utility_result(value)
    }
    fn utility_output(
        &mut self,
        fields: &mut super::schema::UtilitySlots<Tree>,
    ) -> Result<Tree, DecodeError> {
        self.0.utility_output(fields)
    }
    fn output(
        &mut self,
        fields: &mut super::schema::OutputSlots<Tree>,
    ) -> Result<Tree, DecodeError> {
        self.0.output(fields)
    }
    fn message(
        &mut self,
        fields: &mut super::schema::MessageSlots<Tree>,
    ) -> Result<Tree, DecodeError> {
        self.0.message(fields)
    }
}

#[test]
fn builder_errors_get_a_path() {
    let payload = enc(&msg(vec![
        out("ok", &[], vec![]),
        out("refuse", &[], vec![]),
    ]));
    let frames: Vec<&[u8]> = vec![&payload];
    let mut b = Refusing(TreeBuilder::new(&frames));
    let err = decode_outputs(&frames, &mut b, &mut Scratch::default()).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::Foreign);
    assert_eq!(err.path_string(), "outputs[1].request_id");

    let payload = enc(&msg(vec![out_with(11, arr_inline("<i2", &[1], &[0, 0]))]));
    let frames: Vec<&[u8]> = vec![&payload];
    let mut b = Refusing(TreeBuilder::new(&frames));
    let err = decode_outputs(&frames, &mut b, &mut Scratch::default()).unwrap_err();
    assert_eq!(err.to_string(), "outputs[0].routed_experts: no <i2");
}

#[test]
fn messages_of_every_error_render() {
    // Display never panics and always names the place.
    let kinds = [
        ErrorKind::EmptyMessage,
        ErrorKind::BadFrame {
            index: 1,
            detail: "not bytes".into(),
        },
        ErrorKind::ShapeOverflow,
        ErrorKind::UnhashableKey,
        ErrorKind::Foreign,
        ErrorKind::IntOutOfRange {
            value: 1,
            min: 2,
            max: 3,
        },
    ];
    for kind in kinds {
        let text = DecodeError::new(kind.clone()).at_field("x").to_string();
        assert!(text.starts_with("x: "), "{text}");
        let top = DecodeError::new(kind).to_string();
        assert!(top.starts_with("EngineCoreOutputs: "), "{top}");
    }
    let long_key = "k".repeat(100);
    let text = DecodeError::new(ErrorKind::InvalidUtf8)
        .at_key(&long_key)
        .to_string();
    assert!(text.len() < 100, "long keys are shortened: {text}");
}

/// A cheap deterministic PRNG (xorshift) for the mutation test.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn mutated_frames_never_panic() {
    let aux = vec![1u8; 256];
    let base = enc(&a(vec![
        i(0),
        a(vec![out(
            "cmpl-0",
            &[1, 150_000],
            vec![
                a(vec![
                    arr_inline("<i4", &[1, 2], &[0; 8]),
                    arr_inline("<f4", &[1, 2], &[0; 8]),
                    arr_inline("<i4", &[1], &[0; 4]),
                    V::Nil,
                ]),
                V::Nil,
                a(vec![s("float32"), a(vec![i(64)]), i(1)]),
                i(1),
                s("stop"),
                a(vec![V::M(vec![
                    (s("type"), i(1)),
                    (s("timestamp"), V::F(1.0)),
                ])]),
                V::M(vec![(s("k"), a(vec![i(1), V::F32(2.0)]))]),
            ],
        )]),
        V::M(vec![(s("n"), i(1))]),
        V::F(1.0),
        a(vec![i(-1), V::Nil, a(vec![V::Nil, a(vec![s("x"), i(0)])])]),
        a(vec![s("cmpl-0")]),
    ]));
    let frames: Vec<&[u8]> = vec![&base, &aux];
    assert!(decode_frames(&frames).is_ok());
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut ok = 0;
    for _ in 0..30_000 {
        let mut bytes = base.clone();
        match rng.below(4) {
            0 => {
                let at = rng.below(bytes.len());
                bytes[at] = rng.next() as u8;
            }
            1 => bytes.truncate(rng.below(bytes.len())),
            2 => {
                let at = rng.below(bytes.len());
                bytes.insert(at, rng.next() as u8);
            }
            _ => {
                let from = rng.below(bytes.len());
                let to = rng.below(bytes.len());
                let (lo, hi) = (from.min(to), from.max(to));
                let chunk = base[lo..hi].to_vec();
                let at = rng.below(bytes.len());
                bytes.splice(at..at, chunk);
            }
        }
        let frames: Vec<&[u8]> = vec![&bytes, &aux];
        if decode_frames(&frames).is_ok() {
            ok += 1;
        }
    }
    // Some mutations still decode (e.g. a changed token id); most must not.
    assert!(ok > 0 && ok < 30_000, "{ok}");
}

#[test]
fn utility_type_info_is_checked_then_ignored() {
    let with_info = |info: V| {
        a(vec![
            i(0),
            a(vec![]),
            V::Nil,
            V::F(0.0),
            a(vec![i(1), V::Nil, a(vec![info, i(5)])]),
        ])
    };
    let m = decode(&with_info(a(vec![s("some.module"), s("Type")]))).unwrap();
    let Tree::UtilityOutput { result, .. } = m[MF::UtilityOutput].clone() else {
        panic!()
    };
    assert_eq!(*result, Tree::UtilityResult(Box::new(Tree::Int(5))));
    let err = decode_err(&with_info(a(vec![V::Raw(vec![0xff])])));
    assert_eq!(err.kind(), &ErrorKind::InvalidUtf8);
    assert_eq!(err.path_string(), "utility_output.result[0][0]");
    let err = decode_err(&with_info(V::Ext(-127, vec![0])));
    assert_eq!(err.kind(), &ErrorKind::UnknownExt { code: -127 });
}

// ------------------------------------------------------------------ a second version

/// A later protocol version, as corewire would add one: data only. Like vLLM 0.33.0 it
/// inserts a field at position 8 of `EngineCoreOutput` (shifting every later field) and
/// appends one; this build reads both past (a version that surfaces them adds their
/// rows to the field table, which the objects then carry as attributes).
enum Inserted {}

const INSERTED: Layout = Layout {
    version: "test: a field inserted at 8, one appended",
    message: LAYOUT_0_25_1.message,
    output: layout!(OutputField[
        RequestId, NewTokenIds, NewLogprobs, NewPromptLogprobsTensors, PoolingOutput,
        FinishReason, StopReason, Events, Skip, KvTransferParams, TraceHeaders,
        PrefillStats, RoutedExperts, NumNansInLogits, Skip,
    ]),
    utility_output: LAYOUT_0_25_1.utility_output,
    logprobs_lists: LAYOUT_0_25_1.logprobs_lists,
    logprobs_tensors: LAYOUT_0_25_1.logprobs_tensors,
    sampling_mask: None,
};

impl Version for Inserted {
    const LAYOUT: &'static Layout = &INSERTED;
}

/// A version that predates `routed_experts` and `num_nans_in_logits`: they take their
/// defaults, and an older peer's longer frame has them read past.
enum Older {}

const OLDER: Layout = Layout {
    version: "test: the last two output fields absent",
    message: LAYOUT_0_25_1.message,
    output: layout!(OutputField[
        RequestId, NewTokenIds, NewLogprobs, NewPromptLogprobsTensors, PoolingOutput,
        FinishReason, StopReason, Events, KvTransferParams, TraceHeaders, PrefillStats,
    ]),
    utility_output: LAYOUT_0_25_1.utility_output,
    logprobs_lists: LAYOUT_0_25_1.logprobs_lists,
    logprobs_tensors: LAYOUT_0_25_1.logprobs_tensors,
    sampling_mask: None,
};

impl Version for Older {
    const LAYOUT: &'static Layout = &OLDER;
}

fn decode_as<W: Version>(msg: &V) -> Result<MessageTree, DecodeError> {
    let payload = enc(msg);
    let frames: Vec<&[u8]> = vec![&payload];
    let mut b = TreeBuilder::new(&frames);
    decode_outputs_as::<W, _>(&frames, &mut b, &mut Scratch::default()).map(Tree::into_message)
}

/// The 13 fields of a 0.25.1 output after its id and tokens, every one set.
fn full_output_fields() -> Vec<V> {
    vec![
        V::Nil,
        V::Nil,
        V::Nil,
        i(1),
        i(128_001),
        V::Nil,
        V::M(vec![(s("remote"), i(7))]),
        V::M(vec![(s("traceparent"), s("00-ab"))]),
        V::M(vec![(s("num_cached_tokens"), i(12))]),
        arr_inline("|b1", &[2], &[1, 0]),
        i(3),
    ]
}

#[test]
fn a_version_table_maps_shifted_positions_to_the_same_fields() {
    let fields = full_output_fields();
    let expected = only_output(decode(&msg(vec![out("r", &[5], fields.clone())])).unwrap());
    assert_eq!(
        expected[OF::KvTransferParams],
        Tree::Dict(vec![(s_tree("remote"), Tree::Int(7))])
    );

    // The later layout: a value at position 8 (index 6 of `fields`), the rest shifted,
    // one more appended.
    let mut shifted = fields;
    shifted.insert(6, V::M(vec![(s("ec_connector"), s("x"))]));
    shifted.push(s("an error"));
    let frame = msg(vec![out("r", &[5], shifted)]);
    let got = only_output(decode_as::<Inserted>(&frame).unwrap());
    assert_eq!(got, expected);

    // Read with 0.25.1's table the same frame is something else: every field after
    // position 7 lands one slot off (here kv_transfer_params' map in trace_headers).
    let err = decode(&frame).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].trace_headers[\"remote\"]");
}

#[test]
fn fields_a_version_lacks_take_their_defaults() {
    let full = msg(vec![out("r", &[5], full_output_fields())]);
    let o = only_output(decode_as::<Older>(&full).unwrap());
    assert_eq!(o[OF::RoutedExperts], Tree::None);
    assert_eq!(o[OF::NumNansInLogits], Tree::Int(0));
    assert_eq!(o[OF::StopReason], Tree::Int(128_001));
    // the current table reads them
    let o = only_output(decode(&full).unwrap());
    assert_eq!(o[OF::NumNansInLogits], Tree::Int(3));
}

#[test]
fn positions_read_past_are_still_checked() {
    // An invalid value at a skipped position fails like any other, with its place.
    let mut fields = full_output_fields();
    fields.insert(6, V::Pre(vec![0xc1]));
    let err = decode_as::<Inserted>(&msg(vec![out("r", &[5], fields)])).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0][8]");
}

#[test]
fn the_current_layout_names_every_field_once_in_slot_order() {
    // 0.25.1's wire order starts the slot order of every table (so `__struct_fields__`,
    // the attributes and repr list it first); later versions' fields follow.
    fn check<F: WireStruct>(l: &StructLayout<F>) {
        let fields: Vec<F> = l.fields.iter().map(|f| f.expect("no skip")).collect();
        assert_eq!(fields, F::ALL[..fields.len()], "{}", F::STRUCT);
    }
    check(&LAYOUT_0_25_1.message);
    check(&LAYOUT_0_25_1.output);
    check(&LAYOUT_0_25_1.utility_output);
    check(&LAYOUT_0_25_1.logprobs_lists);
    check(&LAYOUT_0_25_1.logprobs_tensors);
    assert_eq!(LAYOUT_0_25_1.output.min_len, 2);
    assert_eq!(LAYOUT_0_25_1.utility_output.min_len, 1);
    assert_eq!(LAYOUT_0_25_1.logprobs_lists.min_len, 3);
    assert_eq!(LAYOUT_0_25_1.message.min_len, 0);
    assert_eq!(
        wire_fields(CURRENT, "EngineCoreEvent"),
        Some(vec!["type", "timestamp"])
    );
    assert_eq!(wire_fields(CURRENT, "SamplingParams"), None);
    assert_eq!(
        wire_fields(&INSERTED, "EngineCoreOutput").unwrap()[8],
        SKIPPED
    );
}

fn s_tree(v: &str) -> Tree {
    Tree::Str(v.to_owned())
}

// ------------------------------------------------------------------ vLLM 0.33.0

fn decode_0_33_0(msg: &V) -> Result<MessageTree, DecodeError> {
    decode_as::<V0_33_0>(msg)
}

/// An 0.33.0 output: `fields` from index 2 on, the rest nil (19 positions).
fn out_0_33_0(id: &str, set: Vec<(usize, V)>) -> V {
    let mut fields = vec![V::Nil; 17];
    fields[11] = i(0); // num_nans_in_logits, at 13
    for (pos, v) in set {
        fields[pos - 2] = v;
    }
    out(id, &[5], fields)
}

#[test]
fn the_0_33_0_layout_reads_every_new_field() {
    let error = V::M(vec![
        (s("code"), s("engine_paused")),
        (s("message"), s("paused")),
        (s("retryable"), V::B(true)),
    ]);
    let mask = a(vec![
        arr_inline("<i4", &[2], &[4, 0, 0, 0, 5, 0, 0, 0]),
        V::Nil,
        V::Nil,
    ]);
    let frame = V::A(vec![
        i(0),
        a(vec![out_0_33_0(
            "r",
            vec![
                (8, V::M(vec![(s("k"), i(1))])),
                (9, V::M(vec![(s("e"), i(2))])),
                (10, V::M(vec![(s("t"), s("h"))])),
                (13, i(7)),
                (14, a(vec![s("h1")])),
                (15, mask),
                (16, V::M(vec![(s("num_spec_tokens"), i(2))])),
                (17, arr_inline("float32", &[1], &[0, 0, 128, 63])),
                (18, error.clone()),
            ],
        )]),
        V::Nil,
        V::F(1.0),
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
        s("default"),
    ]);
    let m = decode_0_33_0(&frame).unwrap();
    assert_eq!(m.fields[MF::WeightVersion], s_tree("default"));
    let o = &m.outputs[0];
    assert_eq!(
        o[OF::KvTransferParams],
        Tree::Dict(vec![(s_tree("k"), Tree::Int(1))])
    );
    assert_eq!(
        o[OF::EcTransferParams],
        Tree::Dict(vec![(s_tree("e"), Tree::Int(2))])
    );
    assert_eq!(
        o[OF::TraceHeaders],
        Tree::Dict(vec![(s_tree("t"), s_tree("h"))])
    );
    assert_eq!(o[OF::NumNansInLogits], Tree::Int(7));
    assert_eq!(o[OF::MmCacheMissHashes], Tree::List(vec![s_tree("h1")]));
    assert!(matches!(&o[OF::NewSamplingMask], Tree::Tuple(items) if items.len() == 3));
    assert!(matches!(
        &o[OF::PromptTokenIdLogprobs],
        Tree::Array {
            kind: ArrayKind::Tensor,
            ..
        }
    ));
    assert!(matches!(&o[OF::Error], Tree::Dict(entries) if entries.len() == 3));

    // The same frame under 0.25.1 fails (here at ec_transfer_params' int, read as the
    // str values of trace_headers); a plain one where a count meets nil at 12.
    let err = decode(&frame).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].trace_headers[\"e\"]");
    let plain = V::A(vec![i(0), a(vec![out_0_33_0("r", vec![])])]);
    let err = decode(&plain).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].num_nans_in_logits");
    assert!(decode_0_33_0(&plain).is_ok());
}

#[test]
fn a_0_25_1_output_fails_under_0_33_0() {
    // 0.25.1 writes num_nans_in_logits (an int) at 12, where 0.33.0 reads an ndarray.
    let mut plain = vec![V::Nil; 10];
    plain.push(i(0));
    let err = decode_0_33_0(&msg(vec![out("r", &[5], plain)])).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].routed_experts");
    // with every field set it fails earlier (prefill_stats' map as trace_headers)
    let full = msg(vec![out("r", &[5], full_output_fields())]);
    assert!(decode_0_33_0(&full).is_err());
    // Messages without outputs read alike in both (the documented limitation).
    let empty = V::A(vec![i(1), a(vec![]), V::Nil, V::F(2.0)]);
    assert_eq!(decode_0_33_0(&empty).unwrap(), decode(&empty).unwrap());
}

#[test]
fn request_errors_are_checked() {
    let with = |e: V| V::A(vec![i(0), a(vec![out_0_33_0("r", vec![(18, e)])])]);
    let err = decode_0_33_0(&with(V::M(vec![(s("code"), s("x"))]))).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::MissingKey { key: "message" });
    assert_eq!(err.path_string(), "outputs[0].error");
    let bad = V::M(vec![
        (s("code"), s("x")),
        (s("message"), s("m")),
        (s("retryable"), i(1)),
    ]);
    let err = decode_0_33_0(&with(bad)).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].error[\"retryable\"]");
    let err = decode_0_33_0(&with(V::M(vec![(s("code"), i(1))]))).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].error[\"code\"]");
    // unknown keys pass (and reach the builder)
    let extra = V::M(vec![
        (s("code"), s("x")),
        (s("message"), s("m")),
        (s("more"), i(1)),
    ]);
    assert!(decode_0_33_0(&with(extra)).is_ok());
}

#[test]
fn the_0_33_0_logprobs_tensors_have_five_elements() {
    let t = |v: u8| arr_inline("int32", &[1], &[v, 0, 0, 0]);
    let tensors = a(vec![t(1), t(2), t(3), a(vec![i(0), i(1)]), t(4)]);
    let frame = V::A(vec![
        i(0),
        a(vec![out_0_33_0("r", vec![(3, tensors.clone())])]),
    ]);
    let o = &decode_0_33_0(&frame).unwrap().outputs[0];
    match &o[OF::NewPromptLogprobsTensors] {
        Tree::Logprobs { later, .. } => {
            assert!(matches!(later.as_slice(), [Tree::Array { .. }]));
        }
        other => panic!("{other:?}"),
    }
    // 0.25.1 reads the fifth element past (its frames never have one).
    let old = msg(vec![out("r", &[5], vec![V::Nil, tensors])]);
    let o = only_output(decode(&old).unwrap());
    assert!(
        matches!(&o[OF::NewPromptLogprobsTensors], Tree::Logprobs { later, .. }
        if later == &vec![Tree::None])
    );
}

#[test]
fn the_0_33_0_layout_appends_and_inserts_only() {
    let old = wire_fields(&LAYOUT_0_25_1, "EngineCoreOutput").unwrap();
    let new = wire_fields(&LAYOUT_0_33_0, "EngineCoreOutput").unwrap();
    assert_eq!(new.len(), 19);
    assert_eq!(new[9], "ec_transfer_params");
    let mut without = new.clone();
    without.remove(9);
    assert_eq!(without[..13], old[..]);
    assert_eq!(LAYOUT_0_33_0.output.min_len, 2);
    assert_eq!(LAYOUT_0_33_0.logprobs_tensors.min_len, 3);
    assert_eq!(wire_fields(&LAYOUT_0_25_1, "SamplingMaskLists"), None);
}

// ------------------------------------------------------------------ layouts made at run time

/// The field names of every struct of `layout`, as a release's own declarations give them.
fn names_of(layout: &Layout) -> Vec<(&'static str, Vec<&'static str>)> {
    [
        "EngineCoreOutputs",
        "EngineCoreOutput",
        "UtilityOutput",
        "LogprobsLists",
        "LogprobsTensors",
        "SamplingMaskLists",
    ]
    .into_iter()
    .filter_map(|n| wire_fields(layout, n).map(|f| (n, f)))
    .collect()
}

fn from_names(version: &str, names: &[(&str, Vec<&str>)]) -> Result<LayoutRef, LayoutError> {
    let get = |n: &str| {
        names
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.as_slice())
    };
    layout_from_names(
        version,
        LayoutNames {
            message: get("EngineCoreOutputs").unwrap(),
            output: get("EngineCoreOutput").unwrap(),
            utility_output: get("UtilityOutput").unwrap(),
            logprobs_lists: get("LogprobsLists").unwrap(),
            logprobs_tensors: get("LogprobsTensors").unwrap(),
            sampling_mask: get("SamplingMaskLists"),
        },
    )
}

/// The names of a later release than any compiled one: 0.34.0's with `error` dropped
/// from `EngineCoreOutput` (so `watermarking` moves up to 18).
fn names_of_a_later_release() -> Vec<(&'static str, Vec<&'static str>)> {
    let mut names = names_of(&LAYOUT_0_34_0);
    names[1].1.retain(|n| *n != "error");
    names
}

fn decode_in(layout: LayoutRef, msg: &V) -> Result<MessageTree, DecodeError> {
    let payload = enc(msg);
    let frames: Vec<&[u8]> = vec![&payload];
    let mut b = TreeBuilder::new(&frames);
    decode_outputs_for(layout, &frames, &mut b, &mut Scratch::default()).map(Tree::into_message)
}

#[test]
fn names_of_a_compiled_layout_give_its_compiled_walk() {
    for p in Protocol::ALL {
        let made = from_names("any name", &names_of(p.layout())).unwrap();
        assert_eq!(made, LayoutRef::Builtin(p));
    }
}

#[test]
fn a_layout_made_at_run_time_reads_a_later_release() {
    let made = from_names("0.35.0", &names_of_a_later_release()).unwrap();
    let LayoutRef::Dynamic(layout) = made else {
        panic!("{made:?}")
    };
    assert_eq!(layout.version, "0.35.0");
    assert_eq!(layout.output.fields.len(), 19);
    // Made once: the same names give the same layout.
    assert_eq!(
        from_names("0.35.0", &names_of_a_later_release()).unwrap(),
        made
    );
    let mut fields = vec![V::Nil; 16];
    fields[11] = i(3);
    fields.push(V::B(true));
    let frame = V::A(vec![
        i(1),
        a(vec![out("r", &[5, 6], fields.clone())]),
        V::Nil,
        V::F(2.5),
    ]);
    let m = decode_in(made, &frame).unwrap();
    let o = &m.outputs[0];
    assert_eq!(o[OF::Watermarking], Tree::Bool(true));
    assert_eq!(o[OF::NumNansInLogits], Tree::Int(3));
    assert_eq!(o[OF::Error], Tree::None);
    // A wrong type is refused by name, as vLLM's own decoder refuses it.
    let mut bad = fields;
    *bad.last_mut().unwrap() = i(1);
    let err = decode_in(made, &V::A(vec![i(1), a(vec![out("r", &[5], bad)])])).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].watermarking");
    // The compiled 0.34.0 walk reads that position as `error`, and refuses the bool.
    let err = decode_in(LayoutRef::Builtin(Protocol::V0_34_0), &frame).unwrap_err();
    assert_eq!(err.path_string(), "outputs[0].error");
}

#[test]
fn the_runtime_walk_reads_what_the_compiled_walk_reads() {
    // 0.33.0's positions in a layout the walk reads at run time (a copy that differs
    // only in not being compiled): values and errors alike.
    let leaked: &'static Layout = Box::leak(Box::new(Layout {
        version: "runtime copy of 0.33.0",
        ..LAYOUT_0_33_0
    }));
    let runtime = LayoutRef::Dynamic(leaked);
    let frames = [
        V::A(vec![
            i(0),
            a(vec![out_0_33_0(
                "r",
                vec![(13, i(7)), (14, a(vec![s("h")]))],
            )]),
        ]),
        V::A(vec![
            i(2),
            a(vec![]),
            V::Nil,
            V::F(1.0),
            V::Nil,
            a(vec![s("x")]),
            i(3),
            V::Nil,
            s("v"),
        ]),
        V::A(vec![
            i(0),
            a(vec![out_0_33_0(
                "r",
                vec![(18, V::M(vec![(s("code"), s("c")), (s("message"), s("m"))]))],
            )]),
        ]),
    ];
    for frame in &frames {
        assert_eq!(
            decode_in(runtime, frame).unwrap(),
            decode_0_33_0(frame).unwrap()
        );
    }
    let bad = V::A(vec![i(0), a(vec![out_0_33_0("r", vec![(13, s("x"))])])]);
    assert_eq!(
        decode_in(runtime, &bad).unwrap_err().to_string(),
        decode_0_33_0(&bad).unwrap_err().to_string()
    );
}

#[test]
fn names_the_decoder_cannot_read_are_refused_by_name() {
    let mut names = names_of(&LAYOUT_0_34_0);
    names[1].1.push("a_field_of_2027");
    let err = from_names("x", &names).unwrap_err();
    assert_eq!(
        err.to_string(),
        "EngineCoreOutput field \"a_field_of_2027\" (position 20) is not one the native decoder reads"
    );
    let mut names = names_of(&LAYOUT_0_25_1);
    names[1].1.retain(|n| *n != "new_token_ids");
    assert!(matches!(
        from_names("x", &names),
        Err(LayoutError::MissingRequired {
            name: "new_token_ids",
            ..
        })
    ));
    let mut names = names_of(&LAYOUT_0_25_1);
    names[0].1.push("timestamp");
    assert!(matches!(
        from_names("x", &names),
        Err(LayoutError::Duplicate { .. })
    ));
    let mut names = names_of(&LAYOUT_0_25_1);
    names[0].1.extend(["timestamp"; 30]);
    assert!(matches!(
        from_names("x", &names),
        Err(LayoutError::TooLong { len: 38, .. })
    ));
}
