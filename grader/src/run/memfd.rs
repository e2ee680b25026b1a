//! Host memory both processes map: an anonymous memory file the judge creates and the runner
//! inherits as a descriptor. The control page is one of these.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// One side's mapping of a memory file.
pub struct SharedMemory {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory that lives as long as the value; what is stored in it, and how
// it is synchronised between processes, is the owner's concern (atomics, or a protocol that orders
// the accesses).
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates a zero-filled memory file of `len` bytes named `name` and maps it.
    pub fn create(name: &CStr, len: usize) -> std::io::Result<SharedMemory> {
        // SAFETY: the name is a valid C string; the flags are plain constants.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a valid descriptor and a size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Self::map(fd, len)
    }

    /// Maps `len` bytes of a memory file the judge passed down (the runner's side).
    pub fn map(fd: OwnedFd, len: usize) -> std::io::Result<SharedMemory> {
        // SAFETY: maps `len` bytes of a descriptor shared between processes; a file shorter than that
        // fails with SIGBUS only on access past its end, which the protocol's fixed sizes prevent.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedMemory { ptr: p.cast(), len, fd })
    }

    /// The descriptor, for handing the memory to the child.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; nothing refers to it afterwards.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
