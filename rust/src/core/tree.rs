//! A [`Builder`] that makes plain Rust values: the schema's tests and the fuzz target
//! decode with it, so the whole walk (and every error) runs without Python.

use super::error::{ArrayKind, DecodeError, DecodeResult, ErrorKind};
use super::msgpack::check_utf8;
use super::schema::{ArrayRef, Builder, MessageParts, OutputParts};

/// A decoded value.
#[derive(Clone, Debug, PartialEq)]
pub enum Tree {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Tree>),
    Tuple(Vec<Tree>),
    /// Entries in wire order; a later duplicate key replaces the earlier one in place.
    Dict(Vec<(Tree, Tree)>),
    /// Elements in first-seen order, without duplicates.
    Set(Vec<Tree>),
    Event {
        kind: u8,
        timestamp: f64,
    },
    Array {
        kind: ArrayKind,
        dtype: String,
        shape: Vec<usize>,
        /// The exact bytes the array views.
        data: Vec<u8>,
        /// Which frame they live in (0 = inline in the payload).
        frame: usize,
    },
    Logprobs {
        kind: ArrayKind,
        arrays: Vec<Tree>,
        cu_num_generated_tokens: Box<Tree>,
    },
    UtilityResult(Box<Tree>),
    UtilityOutput {
        call_id: i128,
        failure_message: Box<Tree>,
        result: Box<Tree>,
    },
    Output(Box<OutputTree>),
    Message(Box<MessageTree>),
}

/// A decoded `EngineCoreOutput`.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputTree {
    pub request_id: Tree,
    pub new_token_ids: Vec<i128>,
    pub new_logprobs: Tree,
    pub new_prompt_logprobs_tensors: Tree,
    pub pooling_output: Tree,
    pub finish_reason: Option<u8>,
    pub stop_reason: Tree,
    pub events: Tree,
    pub kv_transfer_params: Tree,
    pub trace_headers: Tree,
    pub prefill_stats: Tree,
    pub routed_experts: Tree,
    pub num_nans_in_logits: i128,
}

/// A decoded `EngineCoreOutputs`.
#[derive(Clone, Debug, PartialEq)]
pub struct MessageTree {
    pub engine_index: i128,
    pub outputs: Vec<OutputTree>,
    pub scheduler_stats: Tree,
    pub timestamp: f64,
    pub utility_output: Tree,
    pub finished_requests: Tree,
    pub wave_complete: Option<i128>,
    pub start_wave: Option<i128>,
}

impl Tree {
    /// The message inside a `Tree::Message` (panics otherwise: for tests).
    pub fn into_message(self) -> MessageTree {
        match self {
            Tree::Message(m) => *m,
            other => panic!("not a message: {other:?}"),
        }
    }
}

fn opt(v: Option<Tree>) -> Tree {
    v.unwrap_or(Tree::None)
}

/// Bytes per element of a numpy `dtype.str` such as `"<f4"`, `"|b1"`, `"<U3"`,
/// `"<M8[ns]"`; `None` for anything else, including object dtypes.
pub fn numpy_itemsize(dtype: &str) -> Option<usize> {
    let rest = dtype.strip_prefix(['<', '>', '|', '=']).unwrap_or(dtype);
    let mut chars = rest.chars();
    let kind = chars.next()?;
    let tail = chars.as_str();
    let digits_end = tail
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(tail.len());
    let (digits, unit) = tail.split_at(digits_end);
    let size: usize = digits.parse().ok()?;
    match kind {
        'b' | 'i' | 'u' | 'f' | 'c' | 'S' | 'V' if unit.is_empty() => Some(size),
        'U' if unit.is_empty() => size.checked_mul(4),
        'm' | 'M' if size == 8 && (unit.is_empty() || unit.starts_with('[')) => Some(8),
        _ => None,
    }
}

/// Bytes per element of a torch dtype name (`"bfloat16"`); `None` if unknown.
pub fn torch_itemsize(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "bool" | "uint8" | "int8" | "float8_e4m3fn" | "float8_e5m2" | "float8_e4m3fnuz"
        | "float8_e5m2fnuz" | "float8_e8m0fnu" | "quint8" | "qint8" => 1,
        "int16" | "short" | "uint16" | "float16" | "half" | "bfloat16" => 2,
        "int32" | "int" | "uint32" | "float32" | "float" | "complex32" | "chalf" | "qint32" => 4,
        "int64" | "long" | "uint64" | "float64" | "double" | "complex64" | "cfloat" => 8,
        "complex128" | "cdouble" => 16,
        _ => return None,
    })
}

/// Builds [`Tree`]s; knows dtypes through [`numpy_itemsize`] and [`torch_itemsize`].
pub struct TreeBuilder<'f> {
    frames: &'f [&'f [u8]],
}

impl<'f> TreeBuilder<'f> {
    /// A builder for a message made of `frames` (the ones passed to the decoder).
    pub fn new(frames: &'f [&'f [u8]]) -> Self {
        TreeBuilder { frames }
    }
}

impl Builder for TreeBuilder<'_> {
    type Obj = Tree;

    fn none(&mut self) -> Tree {
        Tree::None
    }
    fn bool(&mut self, v: bool) -> Tree {
        Tree::Bool(v)
    }
    fn int(&mut self, v: i128) -> DecodeResult<Tree> {
        Ok(Tree::Int(v))
    }
    fn float(&mut self, v: f64) -> DecodeResult<Tree> {
        Ok(Tree::Float(v))
    }
    fn str(&mut self, v: &str) -> DecodeResult<Tree> {
        Ok(Tree::Str(v.to_owned()))
    }
    fn bytes(&mut self, v: &[u8]) -> DecodeResult<Tree> {
        Ok(Tree::Bytes(v.to_vec()))
    }
    fn list(&mut self, len: usize) -> DecodeResult<Tree> {
        Ok(Tree::List(vec![Tree::None; len]))
    }
    fn list_set(&mut self, list: &mut Tree, index: usize, item: Tree) {
        if let Tree::List(items) = list {
            items[index] = item;
        }
    }
    fn tuple_from_list(&mut self, list: Tree) -> DecodeResult<Tree> {
        match list {
            Tree::List(items) => Ok(Tree::Tuple(items)),
            other => Ok(other),
        }
    }
    fn dict(&mut self) -> DecodeResult<Tree> {
        Ok(Tree::Dict(Vec::new()))
    }
    fn dict_set(&mut self, dict: &mut Tree, key: Tree, value: Tree) -> DecodeResult<()> {
        if let Tree::Dict(entries) = dict {
            match entries.iter_mut().find(|(k, _)| *k == key) {
                Some(entry) => entry.1 = value,
                None => entries.push((key, value)),
            }
        }
        Ok(())
    }
    fn set(&mut self) -> DecodeResult<Tree> {
        Ok(Tree::Set(Vec::new()))
    }
    fn set_add(&mut self, set: &mut Tree, item: Tree) -> DecodeResult<()> {
        if let Tree::Set(items) = set {
            if !items.contains(&item) {
                items.push(item);
            }
        }
        Ok(())
    }
    fn request_id(&mut self, raw: &[u8]) -> DecodeResult<Tree> {
        Ok(Tree::Str(check_utf8(raw)?.to_owned()))
    }
    fn event(&mut self, kind: u8, timestamp: f64) -> DecodeResult<Tree> {
        Ok(Tree::Event { kind, timestamp })
    }
    fn dtype_itemsize(&mut self, kind: ArrayKind, dtype: &str) -> DecodeResult<usize> {
        let size = match kind {
            ArrayKind::Ndarray => numpy_itemsize(dtype),
            ArrayKind::Tensor => torch_itemsize(dtype),
        };
        size.ok_or_else(|| {
            DecodeError::new(ErrorKind::UnknownDtype {
                kind,
                dtype: dtype.to_owned(),
            })
        })
    }
    fn array(&mut self, a: &ArrayRef<'_>) -> DecodeResult<Tree> {
        let frame = self.frames[a.data.frame];
        Ok(Tree::Array {
            kind: a.kind,
            dtype: a.dtype.to_owned(),
            shape: a.shape.to_vec(),
            data: frame[a.data.offset..a.data.offset + a.data.len].to_vec(),
            frame: a.data.frame,
        })
    }
    fn logprobs(
        &mut self,
        kind: ArrayKind,
        arrays: [Tree; 3],
        cu_num_generated_tokens: Option<Tree>,
    ) -> DecodeResult<Tree> {
        Ok(Tree::Logprobs {
            kind,
            arrays: arrays.to_vec(),
            cu_num_generated_tokens: Box::new(opt(cu_num_generated_tokens)),
        })
    }
    fn utility_result(&mut self, value: Tree) -> DecodeResult<Tree> {
        Ok(Tree::UtilityResult(Box::new(value)))
    }
    fn utility_output(
        &mut self,
        call_id: i128,
        failure_message: Option<Tree>,
        result: Option<Tree>,
    ) -> DecodeResult<Tree> {
        Ok(Tree::UtilityOutput {
            call_id,
            failure_message: Box::new(opt(failure_message)),
            result: Box::new(opt(result)),
        })
    }
    fn output(&mut self, p: OutputParts<'_, Tree>) -> DecodeResult<Tree> {
        Ok(Tree::Output(Box::new(OutputTree {
            request_id: p.request_id,
            new_token_ids: p.new_token_ids.to_vec(),
            new_logprobs: opt(p.new_logprobs),
            new_prompt_logprobs_tensors: opt(p.new_prompt_logprobs_tensors),
            pooling_output: opt(p.pooling_output),
            finish_reason: p.finish_reason,
            stop_reason: opt(p.stop_reason),
            events: opt(p.events),
            kv_transfer_params: opt(p.kv_transfer_params),
            trace_headers: opt(p.trace_headers),
            prefill_stats: opt(p.prefill_stats),
            routed_experts: opt(p.routed_experts),
            num_nans_in_logits: p.num_nans_in_logits,
        })))
    }
    fn message(&mut self, p: MessageParts<Tree>) -> DecodeResult<Tree> {
        let outputs = match p.outputs {
            Tree::List(items) => items
                .into_iter()
                .filter_map(|t| match t {
                    Tree::Output(o) => Some(*o),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        Ok(Tree::Message(Box::new(MessageTree {
            engine_index: p.engine_index,
            outputs,
            scheduler_stats: opt(p.scheduler_stats),
            timestamp: p.timestamp,
            utility_output: opt(p.utility_output),
            finished_requests: opt(p.finished_requests),
            wave_complete: p.wave_complete,
            start_wave: p.start_wave,
        })))
    }
}
