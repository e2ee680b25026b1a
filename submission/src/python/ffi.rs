//! libpython, opened at run time: the few functions of CPython's C API the runner calls, resolved by
//! name from the shared library the chosen interpreter reported (`probe`). Nothing links libpython,
//! so the grader starts on machines without any Python (pyo3 would link it); every function used is
//! in the stable ABI of Python 3.9 to 3.14.
//!
//! One interpreter per process: the first [`Python::get`] initialises it, and every later call must
//! name the same library. The GIL is released after initialisation and taken by each [`Gil`], so any
//! thread may call in (the tests do; the runner calls from its main thread only).

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

/// `PyObject*`: opaque here.
pub type RawObject = *mut c_void;

/// `Py_file_input`: compile a module's source.
const PY_FILE_INPUT: c_int = 257;

macro_rules! api {
    ($($field:ident: $symbol:literal fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The C API functions the runner calls, copied out of the library (valid while `_lib` is loaded).
        struct Api {
            $($field: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            _lib: Library,
        }

        impl Api {
            fn resolve(lib: Library, path: &Path) -> Result<Api, String> {
                // SAFETY: each type is the C API's declaration of that symbol.
                unsafe {
                    Ok(Api {
                        $($field: *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>($symbol.as_bytes())
                            .map_err(|_| format!("{} has no function {}: it is not a libpython 3.9 to 3.14", path.display(), $symbol))?,)*
                        _lib: lib,
                    })
                }
            }
        }
    };
}

api! {
    decode_locale: "Py_DecodeLocale" fn(*const c_char, *mut usize) -> *mut c_void;
    set_python_home: "Py_SetPythonHome" fn(*const c_void);
    initialize_ex: "Py_InitializeEx" fn(c_int);
    save_thread: "PyEval_SaveThread" fn() -> *mut c_void;
    gil_ensure: "PyGILState_Ensure" fn() -> c_int;
    gil_release: "PyGILState_Release" fn(c_int);
    compile_string: "Py_CompileString" fn(*const c_char, *const c_char, c_int) -> RawObject;
    exec_code_module: "PyImport_ExecCodeModule" fn(*const c_char, RawObject) -> RawObject;
    get_attr_string: "PyObject_GetAttrString" fn(RawObject, *const c_char) -> RawObject;
    call_object: "PyObject_CallObject" fn(RawObject, RawObject) -> RawObject;
    object_str: "PyObject_Str" fn(RawObject) -> RawObject;
    tuple_new: "PyTuple_New" fn(isize) -> RawObject;
    tuple_set_item: "PyTuple_SetItem" fn(RawObject, isize, RawObject) -> c_int;
    tuple_get_item: "PyTuple_GetItem" fn(RawObject, isize) -> RawObject;
    long_from_long_long: "PyLong_FromLongLong" fn(i64) -> RawObject;
    long_as_unsigned_long_long: "PyLong_AsUnsignedLongLong" fn(RawObject) -> u64;
    unicode_from_string_and_size: "PyUnicode_FromStringAndSize" fn(*const c_char, isize) -> RawObject;
    unicode_as_utf8_and_size: "PyUnicode_AsUTF8AndSize" fn(RawObject, *mut isize) -> *const c_char;
    capsule_new: "PyCapsule_New" fn(*mut c_void, *const c_char, *const c_void) -> RawObject;
    err_occurred: "PyErr_Occurred" fn() -> RawObject;
    err_fetch: "PyErr_Fetch" fn(*mut RawObject, *mut RawObject, *mut RawObject);
    inc_ref: "Py_IncRef" fn(RawObject);
    dec_ref: "Py_DecRef" fn(RawObject);
}

/// The embedded interpreter of this process.
pub struct Python {
    api: Api,
    library: PathBuf,
}

static PYTHON: OnceLock<Result<Python, String>> = OnceLock::new();

impl Python {
    /// The interpreter of `library` with its standard library under `home` (`sys.base_prefix`),
    /// initialised on first use.
    pub fn get(library: &Path, home: &str) -> Result<&'static Python, String> {
        let python = PYTHON.get_or_init(|| Python::start(library, home)).as_ref().map_err(Clone::clone)?;
        if python.library != library {
            return Err(format!(
                "this process already runs the Python of {}, not {}",
                python.library.display(),
                library.display()
            ));
        }
        Ok(python)
    }

    fn start(library: &Path, home: &str) -> Result<Python, String> {
        // RTLD_GLOBAL: extension modules (torch._C) take the C API from the global namespace, as
        // they do in an interpreter whose executable holds libpython itself.
        // SAFETY: loading libpython runs its initialisers, which only set up static data.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(library),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| {
            let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string);
            format!("could not load libpython {}: dlopen: {why}", library.display())
        })?;
        let api = Api::resolve(lib.into(), library)?;
        let home = CString::new(home).map_err(|_| format!("the Python home {home:?} holds a NUL byte"))?;
        // SAFETY: Py_DecodeLocale may run before initialisation; Py_SetPythonHome keeps the pointer,
        // so the decoded string is never freed; Py_InitializeEx(0) installs no signal handlers (the
        // runner's own stay); PyEval_SaveThread releases the GIL this thread holds after it.
        unsafe {
            let wide = (api.decode_locale)(home.as_ptr(), std::ptr::null_mut());
            if wide.is_null() {
                return Err(format!("the Python home {home:?} cannot be decoded"));
            }
            (api.set_python_home)(wide);
            (api.initialize_ex)(0);
            (api.save_thread)();
        }
        Ok(Python { api, library: library.to_path_buf() })
    }

    /// Holds the GIL until the guard drops.
    pub fn gil(&self) -> Gil<'_> {
        // SAFETY: the interpreter is initialised; PyGILState_Ensure works from any thread.
        Gil { python: self, state: unsafe { (self.api.gil_ensure)() }, _thread: PhantomData }
    }
}

/// The GIL, held: every object operation goes through it.
pub struct Gil<'p> {
    python: &'p Python,
    state: c_int,
    /// Released on the thread that took it: the guard is neither Send nor Sync.
    _thread: PhantomData<*const ()>,
}

impl Drop for Gil<'_> {
    fn drop(&mut self) {
        // SAFETY: releases the state this guard's PyGILState_Ensure returned, on the same thread.
        unsafe { (self.python.api.gil_release)(self.state) }
    }
}

/// A strong reference, released on drop (the GIL must be held then: objects never outlive their `Gil`).
pub struct Object<'g, 'p> {
    gil: &'g Gil<'p>,
    raw: RawObject,
}

impl Drop for Object<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: a strong reference this guard owns, released once under the GIL.
        unsafe { (self.gil.python.api.dec_ref)(self.raw) }
    }
}

impl<'p> Gil<'p> {
    fn api(&self) -> &Api {
        &self.python.api
    }

    /// A new reference from the C API, or the pending exception as text.
    fn own(&self, raw: RawObject, what: &str) -> Result<Object<'_, 'p>, String> {
        if raw.is_null() { Err(format!("{what}: {}", self.take_error())) } else { Ok(Object { gil: self, raw }) }
    }

    /// The pending Python exception, as text (and cleared).
    fn take_error(&self) -> String {
        let (mut kind, mut value, mut trace) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: PyErr_Fetch hands over three references (or nulls), each released below.
        unsafe { (self.api().err_fetch)(&mut kind, &mut value, &mut trace) };
        let shown = if value.is_null() { kind } else { value };
        // SAFETY: PyObject_Str of a live object returns a new reference or null.
        let text = if shown.is_null() { None } else { Some(unsafe { (self.api().object_str)(shown) }) };
        let message = text.and_then(|t| self.own(t, "").ok()).and_then(|t| t.to_str().ok());
        for raw in [kind, value, trace].into_iter().filter(|r| !r.is_null()) {
            // SAFETY: references handed over by PyErr_Fetch, each released once.
            unsafe { (self.api().dec_ref)(raw) };
        }
        message.unwrap_or_else(|| "an unknown Python error".into())
    }

    /// Runs `source` as a fresh module named `name`.
    pub fn module(&self, name: &str, source: &str, file: &str) -> Result<Object<'_, 'p>, String> {
        let nul = |what: &str| format!("{what} holds a NUL byte");
        let (name, source, file) = (
            CString::new(name).map_err(|_| nul("a module name"))?,
            CString::new(source).map_err(|_| nul("the module source"))?,
            CString::new(file).map_err(|_| nul("a file name"))?,
        );
        // SAFETY: valid NUL-terminated strings; the code object is a new reference, owned below.
        let code = self
            .own(unsafe { (self.api().compile_string)(source.as_ptr(), file.as_ptr(), PY_FILE_INPUT) }, "compiling")?;
        // SAFETY: a valid name and code object; returns a new reference to the module or null.
        self.own(unsafe { (self.api().exec_code_module)(name.as_ptr(), code.raw) }, "running the module")
    }

    /// A new strong reference to a live object held elsewhere: kept (see [`Object::keep`]), or an
    /// item of a live tuple.
    pub fn borrowed(&self, raw: RawObject) -> Object<'_, 'p> {
        // SAFETY: `raw` is a live object (held by a reference that outlives this call).
        unsafe { (self.api().inc_ref)(raw) };
        Object { gil: self, raw }
    }

    pub fn int(&self, v: i64) -> Result<Object<'_, 'p>, String> {
        // SAFETY: returns a new reference or null.
        self.own(unsafe { (self.api().long_from_long_long)(v) }, "making an int")
    }

    pub fn str(&self, s: &str) -> Result<Object<'_, 'p>, String> {
        // SAFETY: a valid pointer and length of UTF-8; returns a new reference or null.
        self.own(
            unsafe { (self.api().unicode_from_string_and_size)(s.as_ptr().cast(), s.len() as isize) },
            "making a str",
        )
    }

    /// A capsule over `pointer` named `name`, with no destructor (its memory is never freed).
    pub fn capsule(&self, pointer: *mut c_void, name: &'static CStr) -> Result<Object<'_, 'p>, String> {
        // SAFETY: a non-null pointer and a static name; returns a new reference or null.
        self.own(unsafe { (self.api().capsule_new)(pointer, name.as_ptr(), std::ptr::null()) }, "making a capsule")
    }

    /// A tuple of `items` (their references are handed to it).
    pub fn tuple(&self, items: Vec<Object<'_, 'p>>) -> Result<Object<'_, 'p>, String> {
        // SAFETY: returns a new reference or null.
        let tuple = self.own(unsafe { (self.api().tuple_new)(items.len() as isize) }, "making a tuple")?;
        for (i, item) in items.into_iter().enumerate() {
            let raw = std::mem::ManuallyDrop::new(item).raw;
            // SAFETY: PyTuple_SetItem steals the reference to a fresh tuple's slot `i`.
            unsafe { (self.api().tuple_set_item)(tuple.raw, i as isize, raw) };
        }
        Ok(tuple)
    }
}

impl<'g, 'p> Object<'g, 'p> {
    /// The reference, kept for the life of the process (reached again with [`Gil::borrowed`]).
    pub fn keep(self) -> RawObject {
        std::mem::ManuallyDrop::new(self).raw
    }

    /// `self.name(*args)`.
    pub fn call_method(&self, name: &str, args: Object<'_, 'p>) -> Result<Object<'g, 'p>, String> {
        let api = self.gil.api();
        let c_name = CString::new(name).map_err(|_| format!("{name:?} holds a NUL byte"))?;
        // SAFETY: a live object and a NUL-terminated name; new reference or null.
        let method = self.gil.own(unsafe { (api.get_attr_string)(self.raw, c_name.as_ptr()) }, name)?;
        // SAFETY: a live callable and a tuple of arguments; new reference or null.
        self.gil.own(unsafe { (api.call_object)(method.raw, args.raw) }, name)
    }

    /// Item `i` of a tuple, as a new reference.
    pub fn item(&self, i: usize) -> Result<Object<'g, 'p>, String> {
        let api = self.gil.api();
        // SAFETY: PyTuple_GetItem returns a borrowed reference or null (not a tuple, out of range).
        let raw = unsafe { (api.tuple_get_item)(self.raw, i as isize) };
        if raw.is_null() {
            return Err(format!("item {i}: {}", self.gil.take_error()));
        }
        Ok(self.gil.borrowed(raw))
    }

    pub fn to_str(&self) -> Result<String, String> {
        let mut len = 0isize;
        // SAFETY: returns a pointer into the str's UTF-8 buffer, valid while the str lives, or null.
        let p = unsafe { (self.gil.api().unicode_as_utf8_and_size)(self.raw, &mut len) };
        if p.is_null() {
            return Err(format!("not a str: {}", self.gil.take_error()));
        }
        // SAFETY: `len` bytes of UTF-8 at `p`, copied out at once.
        Ok(String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len as usize) }).into_owned())
    }

    pub fn to_u64(&self) -> Result<u64, String> {
        // SAFETY: a live object; (u64)-1 with an exception set on failure.
        let v = unsafe { (self.gil.api().long_as_unsigned_long_long)(self.raw) };
        // SAFETY: reads this thread's error indicator (a borrowed pointer, not kept).
        if v == u64::MAX && !unsafe { (self.gil.api().err_occurred)() }.is_null() {
            return Err(format!("not an unsigned int: {}", self.gil.take_error()));
        }
        Ok(v)
    }
}
