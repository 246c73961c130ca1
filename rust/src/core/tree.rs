//! A [`Builder`] that makes plain Rust values: the schema's tests and the fuzz target
//! decode with it, so the whole walk (and every error) runs without Python.

use std::marker::PhantomData;
use std::ops::{Index, IndexMut};

use super::error::{ArrayKind, DecodeError, DecodeResult, ErrorKind};
use super::msgpack::check_utf8;
use super::schema::{ArrayRef, Builder, MessageSlots, OutputSlots, UtilitySlots};
use super::wire::{FieldType, ListsField, MessageField, OutputField, UtilityField, WireStruct};

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
        /// The slots after `cu_num_generated_tokens` (a later version's elements).
        later: Vec<Tree>,
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

/// A decoded struct: its fields by slot of `F`'s table ([`super::wire`]), each absent
/// field as its default (nil, or 0 for a count).
#[derive(Clone, Debug, PartialEq)]
pub struct StructTree<F> {
    fields: Vec<Tree>,
    table: PhantomData<F>,
}

impl<F: WireStruct, const N: usize> From<[Option<Tree>; N]> for StructTree<F> {
    fn from(slots: [Option<Tree>; N]) -> Self {
        let fields = slots
            .into_iter()
            .zip(F::ALL)
            .map(|(v, f)| match (v, f.info().ty) {
                (Some(v), _) => v,
                (None, FieldType::Count) => Tree::Int(0),
                (None, _) => Tree::None,
            })
            .collect();
        StructTree {
            fields,
            table: PhantomData,
        }
    }
}

impl<F: WireStruct> Index<F> for StructTree<F> {
    type Output = Tree;
    fn index(&self, field: F) -> &Tree {
        &self.fields[field.slot()]
    }
}

impl<F: WireStruct> IndexMut<F> for StructTree<F> {
    fn index_mut(&mut self, field: F) -> &mut Tree {
        &mut self.fields[field.slot()]
    }
}

/// A decoded `EngineCoreOutput`.
pub type OutputTree = StructTree<OutputField>;

/// A decoded `EngineCoreOutputs`: its fields, and its outputs taken out of the list
/// that holds them (whose slot is left nil).
#[derive(Clone, Debug, PartialEq)]
pub struct MessageTree {
    pub fields: StructTree<MessageField>,
    pub outputs: Vec<OutputTree>,
}

impl Index<MessageField> for MessageTree {
    type Output = Tree;
    fn index(&self, field: MessageField) -> &Tree {
        &self.fields[field]
    }
}

impl IndexMut<MessageField> for MessageTree {
    fn index_mut(&mut self, field: MessageField) -> &mut Tree {
        &mut self.fields[field]
    }
}

impl Tree {
    /// The list of ints `values` (token ids as the walk hands them over).
    pub fn ints(values: &[i128]) -> Tree {
        Tree::List(values.iter().map(|&v| Tree::Int(v)).collect())
    }

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
    fn token_ids(&mut self, ids: &[i128]) -> DecodeResult<Tree> {
        Ok(Tree::ints(ids))
    }
    fn finish_reason(&mut self, code: u8) -> DecodeResult<Tree> {
        Ok(Tree::Int(code.into()))
    }
    fn logprobs(&mut self, kind: ArrayKind, fields: &mut [Option<Tree>]) -> DecodeResult<Tree> {
        let mut all = fields.iter_mut().map(|f| opt(f.take()));
        let arrays = all.by_ref().take(3).collect();
        debug_assert_eq!(ListsField::CuNumGeneratedTokens.slot(), 3);
        let cu = all.next().unwrap_or(Tree::None);
        Ok(Tree::Logprobs {
            kind,
            arrays,
            cu_num_generated_tokens: Box::new(cu),
            later: all.collect(),
        })
    }
    fn utility_result(&mut self, value: Tree) -> DecodeResult<Tree> {
        Ok(Tree::UtilityResult(Box::new(value)))
    }
    fn utility_output(&mut self, fields: &mut UtilitySlots<Tree>) -> DecodeResult<Tree> {
        // (moved out, not cloned: a deep result's clone would recurse)
        let mut t = StructTree::<UtilityField>::from(std::mem::take(fields));
        let mut take = |f: UtilityField| Box::new(std::mem::replace(&mut t[f], Tree::None));
        let Tree::Int(call_id) = *take(UtilityField::CallId) else {
            return Err(DecodeError::new(ErrorKind::Rejected("no call id".into())));
        };
        Ok(Tree::UtilityOutput {
            call_id,
            failure_message: take(UtilityField::FailureMessage),
            result: take(UtilityField::Result),
        })
    }
    fn output(&mut self, fields: &mut OutputSlots<Tree>) -> DecodeResult<Tree> {
        Ok(Tree::Output(Box::new(OutputTree::from(std::mem::take(
            fields,
        )))))
    }
    fn message(&mut self, fields: &mut MessageSlots<Tree>) -> DecodeResult<Tree> {
        let mut fields = StructTree::<MessageField>::from(std::mem::take(fields));
        let outputs = match std::mem::replace(&mut fields[MessageField::Outputs], Tree::None) {
            Tree::List(items) => items
                .into_iter()
                .filter_map(|t| match t {
                    Tree::Output(o) => Some(*o),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        Ok(Tree::Message(Box::new(MessageTree { fields, outputs })))
    }
}
