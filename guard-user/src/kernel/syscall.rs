//! The raw bpf(2) system call, for what aya 0.14 has no API for (batch lookups, feature
//! probes). Source: include/uapi/linux/bpf.h (`enum bpf_cmd`, `union bpf_attr`).
use std::io;

// enum bpf_cmd.
pub const BPF_PROG_LOAD: libc::c_long = 5;
pub const BPF_PROG_QUERY: libc::c_long = 16;
pub const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
pub const BPF_LINK_CREATE: libc::c_long = 28;

/// bpf(2) with `attr`, a prefix of `union bpf_attr` (the kernel zero-fills the rest).
/// Returns what the call returns (an fd for the commands that create one).
///
/// # Safety
/// `attr` is laid out as the command's member of `union bpf_attr`, and every buffer it
/// points to is valid for the kernel to read and write as the command does. `attr` must
/// reach every field the command writes back: the kernel writes its answers at their
/// offsets whatever size it is given (BPF_PROG_QUERY's count and revision).
pub unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: as the caller promises; the size passed is the attribute's.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as u32,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}
