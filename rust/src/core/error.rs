//! The one error type of frame decoding: what went wrong and where.
//!
//! An error is built where it is detected (`DecodeError::new(kind)`), and each level of
//! the schema walk that it bubbles through adds its own path segment (`.at_field()`,
//! `.at_index()`). Segments are pushed innermost first and printed outermost first:
//! `outputs[3].new_token_ids[2]: expected int, got str`. Everything here is cold.

use std::fmt;

/// A msgpack value's family, for "expected X, got Y" messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

impl Kind {
    /// The name used in error messages (Python-flavoured, like msgspec's).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "int",
            Kind::Float => "float",
            Kind::Str => "str",
            Kind::Bin => "bytes",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "ext",
        }
    }
}

/// Which family of array a `[dtype, shape, data]` triple decodes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArrayKind {
    /// A numpy ndarray; dtype is numpy's `dtype.str` (`"<f4"`).
    Ndarray,
    /// A torch tensor; dtype is the torch name without `torch.` (`"bfloat16"`).
    Tensor,
}

impl ArrayKind {
    /// "ndarray" or "tensor".
    pub fn name(self) -> &'static str {
        match self {
            ArrayKind::Ndarray => "ndarray",
            ArrayKind::Tensor => "tensor",
        }
    }
}

/// What went wrong, without the location.
#[derive(Clone, Debug, PartialEq)]
pub enum ErrorKind {
    /// `decode([])`: no payload frame.
    EmptyMessage,
    /// A frame that is not a contiguous bytes-like object (index, description).
    BadFrame { index: usize, detail: String },
    /// The data ended in the middle of a value.
    Truncated { offset: usize },
    /// A byte that starts no msgpack value (0xc1).
    InvalidMarker { byte: u8, offset: usize },
    /// Bytes left over after the top-level value.
    TrailingBytes { count: usize, offset: usize },
    /// A value of the wrong family at a typed position.
    Type { expected: &'static str, got: Kind },
    /// A struct-like array shorter than its required fields.
    TooShort { min: usize, got: usize },
    /// An array whose length is fixed by the protocol had another length.
    WrongLength { expected: usize, got: usize },
    /// An integer outside the range the field accepts.
    IntOutOfRange { value: i128, min: i128, max: i128 },
    /// A string that is not valid UTF-8.
    InvalidUtf8,
    /// A value outside an enumeration (finish_reason, event type).
    InvalidEnum { what: &'static str, value: i128 },
    /// A container at nesting level `depth` (1: the value of a free-form field's
    /// entry) where at most `limit` levels are allowed.
    TooDeep { depth: usize, limit: usize },
    /// A msgpack extension type other than 3 (raw array data).
    UnknownExt { code: i8 },
    /// Array data must be extension type 3 or an aux frame index.
    BadArrayData { got: Kind },
    /// An aux frame index that names no frame of this message.
    AuxIndexOutOfRange { index: i128, aux_frames: usize },
    /// A dtype the array library does not know (or refuses, like object dtypes).
    UnknownDtype { kind: ArrayKind, dtype: String },
    /// More dimensions than numpy/torch allow.
    TooManyDims { ndim: usize, limit: usize },
    /// A negative dimension.
    NegativeDim { dim: i128 },
    /// Shape and itemsize overflow the address space.
    ShapeOverflow,
    /// The data holds another number of bytes than dtype and shape need.
    ByteLength { needed: u128, got: usize },
    /// A struct-as-map missing a required key.
    MissingKey { key: &'static str },
    /// A map key that is not hashable in Python (a map used as a key).
    UnhashableKey,
    /// A struct-as-map (e.g. an event) whose keys are not strings.
    NonStrKey { got: Kind },
    /// The builder refused a value (message from the builder).
    Rejected(String),
    /// The builder raised a foreign (host-language) error that it keeps itself;
    /// the binding layer re-raises that error instead of this one.
    Foreign,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorKind::EmptyMessage => write!(f, "empty message: no payload frame"),
            ErrorKind::BadFrame { index, detail } => write!(f, "frame {index}: {detail}"),
            ErrorKind::Truncated { offset } => {
                write!(
                    f,
                    "unexpected end of data (byte {offset}): truncated message"
                )
            }
            ErrorKind::InvalidMarker { byte, offset } => {
                write!(f, "not msgpack: invalid byte 0x{byte:02x} at byte {offset}")
            }
            ErrorKind::TrailingBytes { count, offset } => {
                write!(
                    f,
                    "{count} trailing bytes after the message (from byte {offset})"
                )
            }
            ErrorKind::Type { expected, got } => {
                write!(f, "expected {expected}, got {}", got.name())
            }
            ErrorKind::TooShort { min, got } => {
                write!(f, "expected array of at least {min} elements, got {got}")
            }
            ErrorKind::WrongLength { expected, got } => {
                write!(f, "expected array of {expected} elements, got {got}")
            }
            ErrorKind::IntOutOfRange { value, min, max } => {
                write!(f, "integer {value} out of range [{min}, {max}]")
            }
            ErrorKind::InvalidUtf8 => write!(f, "invalid UTF-8 in string"),
            ErrorKind::InvalidEnum { what, value } => write!(f, "invalid {what} value {value}"),
            ErrorKind::TooDeep { depth, limit } => {
                write!(
                    f,
                    "value nested {depth} levels deep, deeper than the {limit} allowed"
                )
            }
            ErrorKind::UnknownExt { code } => write!(f, "unknown msgpack extension type {code}"),
            ErrorKind::BadArrayData { got } => write!(
                f,
                "array data must be extension type 3 or an aux frame index, got {}",
                got.name()
            ),
            ErrorKind::AuxIndexOutOfRange { index, aux_frames } => write!(
                f,
                "aux frame index {index} out of range (message has {aux_frames} aux frames)"
            ),
            ErrorKind::UnknownDtype { kind, dtype } => {
                write!(f, "unknown {} dtype {dtype:?}", kind.name())
            }
            ErrorKind::TooManyDims { ndim, limit } => {
                write!(f, "array has {ndim} dimensions, at most {limit} allowed")
            }
            ErrorKind::NegativeDim { dim } => write!(f, "negative array dimension {dim}"),
            ErrorKind::ShapeOverflow => write!(f, "array shape overflows"),
            ErrorKind::ByteLength { needed, got } => {
                write!(f, "dtype and shape need {needed} bytes of data, got {got}")
            }
            ErrorKind::MissingKey { key } => write!(f, "missing required key {key:?}"),
            ErrorKind::UnhashableKey => write!(f, "map keys must be hashable (got a map)"),
            ErrorKind::NonStrKey { got } => {
                write!(f, "expected str map key, got {}", got.name())
            }
            ErrorKind::Rejected(message) => f.write_str(message),
            ErrorKind::Foreign => write!(f, "error raised while building a value"),
        }
    }
}

/// One step of the path to a failing value.
#[derive(Clone, Debug, PartialEq)]
pub enum Seg {
    /// A named field of a wire struct.
    Field(&'static str),
    /// An element of an array.
    Index(usize),
    /// A value of a map, by its (string) key.
    Key(String),
    /// A map key itself.
    KeyOf(usize),
}

/// Path segments shown in full in an error message; longer paths are shortened.
pub const PATH_SHOWN: usize = 32;

/// A decoding error: what (`kind()`) and where (`path()`, outermost first when displayed).
///
/// Boxed so that `Result<T, DecodeError>` stays two words wide on the hot path.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeError(Box<Inner>);

#[derive(Clone, Debug, PartialEq)]
struct Inner {
    kind: ErrorKind,
    /// Innermost segment first (segments are appended while the error bubbles up).
    path_rev: Vec<Seg>,
}

impl DecodeError {
    /// A new error with an empty path.
    #[cold]
    #[inline(never)]
    pub fn new(kind: ErrorKind) -> Self {
        DecodeError(Box::new(Inner {
            kind,
            path_rev: Vec::new(),
        }))
    }

    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.0.kind
    }

    /// Adds the enclosing struct field to the path.
    #[cold]
    #[inline(never)]
    pub fn at_field(mut self, name: &'static str) -> Self {
        self.0.path_rev.push(Seg::Field(name));
        self
    }

    /// Adds the enclosing array index to the path.
    #[cold]
    #[inline(never)]
    pub fn at_index(mut self, index: usize) -> Self {
        self.0.path_rev.push(Seg::Index(index));
        self
    }

    /// Adds the enclosing map key (shown shortened) to the path.
    #[cold]
    #[inline(never)]
    pub fn at_key(mut self, key: &str) -> Self {
        let mut shown: String = key.chars().take(40).collect();
        if shown.len() < key.len() {
            shown.push('…');
        }
        self.0.path_rev.push(Seg::Key(shown));
        self
    }

    /// Marks that the error is in the key (not the value) of map entry `entry`.
    #[cold]
    #[inline(never)]
    pub fn at_key_of(mut self, entry: usize) -> Self {
        self.0.path_rev.push(Seg::KeyOf(entry));
        self
    }

    /// The path, outermost first.
    pub fn path(&self) -> impl Iterator<Item = &Seg> {
        self.0.path_rev.iter().rev()
    }

    /// The path as text: `outputs[3].new_token_ids[2]`; empty for the top level. A path
    /// longer than [`PATH_SHOWN`] segments (a deeply nested value) shows its first and
    /// last segments around the count of those left out: `a[0][0]…(980 more)…[0][0]`.
    pub fn path_string(&self) -> String {
        let mut out = String::new();
        let len = self.0.path_rev.len();
        let (head, tail) = if len > PATH_SHOWN {
            (PATH_SHOWN / 2, PATH_SHOWN / 4)
        } else {
            (len, 0)
        };
        for (n, seg) in self.path().enumerate() {
            if n == head && head + tail < len {
                out.push_str(&format!("…({} more)…", len - head - tail));
            }
            if n >= head && n < len - tail {
                continue;
            }
            match seg {
                Seg::Field(name) => {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(name);
                }
                Seg::Index(i) => {
                    out.push('[');
                    out.push_str(&i.to_string());
                    out.push(']');
                }
                Seg::Key(k) => {
                    out.push('[');
                    out.push_str(&format!("{k:?}"));
                    out.push(']');
                }
                Seg::KeyOf(i) => {
                    out.push_str(&format!("<key of entry {i}>"));
                }
            }
        }
        out
    }
}

impl From<ErrorKind> for DecodeError {
    #[cold]
    fn from(kind: ErrorKind) -> Self {
        DecodeError::new(kind)
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.path_rev.is_empty() {
            write!(f, "EngineCoreOutputs: {}", self.0.kind)
        } else {
            write!(f, "{}: {}", self.path_string(), self.0.kind)
        }
    }
}

impl std::error::Error for DecodeError {}

/// Result of every decoding step.
pub type DecodeResult<T> = Result<T, DecodeError>;
