//! The byte buffers CUPTI's profiler works on (counter availability, config and counter data
//! images): 8-byte aligned as the profiler requires, zeroed, and never moved or resized once made,
//! because CUPTI keeps pointers to the config and counter data images between calls.

use std::ptr::NonNull;

pub(super) struct Image {
    /// The start of a leaked `Box<[u64]>` of `words` words, reclaimed in `Drop`. Every access goes
    /// through this one pointer, so CUPTI's writes through the pointers it keeps never race a Rust
    /// reference.
    start: NonNull<u64>,
    words: usize,
    len: usize,
}

impl Image {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Image {
        let words = len.div_ceil(size_of::<u64>());
        let boxed: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        let start = NonNull::new(Box::into_raw(boxed).cast::<u64>()).expect("Box::into_raw is never null");
        Image { start, words, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.start.as_ptr().cast::<u8>().cast_const()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.start.as_ptr().cast::<u8>()
    }

    /// The bytes, for tests and checks (no CUPTI call may write meanwhile: it takes `&self`).
    #[cfg(test)]
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `start` points to `words * 8 >= len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.start.as_ptr(), self.words);
        // SAFETY: `start`/`words` are exactly the leaked box of `zeroed`, reclaimed once, here.
        drop(unsafe { Box::from_raw(slice) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_aligned_zeroed_and_sized() {
        for len in [0, 1, 7, 8, 1500] {
            let mut image = Image::zeroed(len);
            assert_eq!(image.len(), len);
            assert_eq!(image.as_ptr() as usize % 8, 0, "8-byte aligned");
            assert!(image.bytes().iter().all(|&b| b == 0));
            assert_eq!(image.as_mut_ptr().cast_const(), image.as_ptr());
        }
    }
}
