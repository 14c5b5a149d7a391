//! The daemon's own memory.

/// Gives the memory freed since the last call back to the kernel. A snapshot or an
/// audit of many destinations takes tens of MiB while it runs, and glibc keeps freed
/// memory in its arena, so without this the daemon would rest near its largest one.
pub fn release_freed_memory() {
    // SAFETY: malloc_trim only walks and shrinks glibc's own heaps.
    unsafe { libc::malloc_trim(0) };
}
