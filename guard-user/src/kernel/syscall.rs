//! The raw bpf(2) system call, for what aya 0.14 has no API for (batch lookups, feature
//! probes). Source: include/uapi/linux/bpf.h (`enum bpf_cmd`, `union bpf_attr`).
use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

// enum bpf_cmd.
pub const BPF_PROG_LOAD: libc::c_long = 5;
pub const BPF_PROG_QUERY: libc::c_long = 16;
pub const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
pub const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
const BPF_LINK_DETACH: libc::c_long = 34;
const BPF_LINK_TYPE_CGROUP: u32 = 3;
// enum bpf_prog_type.
pub const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;
pub const BPF_PROG_TYPE_SOCK_OPS: u32 = 13;

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

/// The object pinned at `path` (BPF_OBJ_GET: pathname, bpf_fd, file_flags).
pub fn obj_get(path: &std::path::Path) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut attr = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: `pathname` is a NUL-terminated string that outlives the call.
    let fd = unsafe { bpf(BPF_OBJ_GET, &mut attr) }?;
    // SAFETY: the kernel returned a new fd, ours to close.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Runs program `prog` once on `data` (BPF_PROG_TEST_RUN; its `test` member: prog_fd,
/// retval, data_size_in, data_size_out, data_in, data_out, repeat, duration); returns
/// what the program returned.
pub fn prog_test_run(prog: BorrowedFd<'_>, data: &[u8]) -> io::Result<u32> {
    #[repr(C)]
    struct TestRun {
        prog_fd: u32,
        retval: u32,
        data_size_in: u32,
        data_size_out: u32,
        data_in: u64,
        data_out: u64,
        repeat: u32,
        duration: u32,
    }
    let mut attr = TestRun {
        prog_fd: prog.as_raw_fd() as u32,
        retval: 0,
        data_size_in: data.len() as u32,
        data_size_out: 0,
        data_in: data.as_ptr() as u64,
        data_out: 0,
        repeat: 1,
        duration: 0,
    };
    // SAFETY: `data` is valid for `data_size_in` bytes; no output buffer is given.
    unsafe { bpf(BPF_PROG_TEST_RUN, &mut attr) }?;
    Ok(attr.retval)
}

/// Moves link `link` to program `prog` (BPF_LINK_UPDATE: link_fd, new_prog_fd, flags,
/// old_prog_fd; no flags: whatever program the link runs now).
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    #[repr(C)]
    struct LinkUpdate {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    let mut attr = LinkUpdate {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    // SAFETY: BPF_LINK_UPDATE reads these four fields.
    unsafe { bpf(BPF_LINK_UPDATE, &mut attr) }?;
    Ok(())
}

/// `struct bpf_link_info`: type, id, prog_id, then the union, whose `cgroup` member
/// starts with the cgroup id.
#[repr(C)]
#[derive(Default)]
struct LinkInfo {
    type_: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    cgroup_id: u64,
    attach_type: u32,
    _rest: [u32; 9],
}

/// The first bytes of an object's info (BPF_OBJ_GET_INFO_BY_FD: bpf_fd, info_len,
/// info), as `T`, a prefix of the object's info struct, plain data.
fn obj_info<T: Default>(fd: BorrowedFd<'_>) -> io::Result<T> {
    #[repr(C)]
    struct GetInfo {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut info = T::default();
    let mut get = GetInfo {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: std::mem::size_of::<T>() as u32,
        info: &raw mut info as u64,
    };
    // SAFETY: `info` is valid for `info_len` bytes.
    unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &mut get) }?;
    Ok(info)
}

fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    obj_info(fd)
}

/// Detaches link `link` at once, in the calling thread (BPF_LINK_DETACH: link_fd). Removing
/// a link's last pin detaches it later: bpffs frees the inode in an RCU callback
/// (bpf_free_inode()), whose bpf_link_put() hands the release to a workqueue
/// (kernel/bpf/inode.c, kernel/bpf/syscall.c). A detached link stays, defunct, until
/// its last reference goes. EOPNOTSUPP for a link type without a detach operation.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = link.as_raw_fd() as u32;
    // SAFETY: BPF_LINK_DETACH reads one field, link_fd.
    unsafe { bpf(BPF_LINK_DETACH, &mut attr) }?;
    Ok(())
}

/// The kernel's id of the link `fd`.
pub fn link_id(fd: BorrowedFd<'_>) -> io::Result<u32> {
    Ok(link_info(fd)?.id)
}

/// The cgroup id a cgroup bpf_link is attached to, by the link's id: 0 once the kernel
/// has detached it itself (cgroup_bpf_release(), when the removed cgroup's last socket
/// is gone, sets the link's cgroup to NULL).
pub fn link_cgroup_id(link_id: u32) -> io::Result<u64> {
    let fd = fd_by_id(BPF_LINK_GET_FD_BY_ID, link_id)?;
    let info = link_info(fd.as_fd())?;
    if info.type_ != BPF_LINK_TYPE_CGROUP {
        return Err(io::Error::other(format!(
            "link {link_id} is of type {}, not a cgroup link",
            info.type_
        )));
    }
    Ok(info.cgroup_id)
}

/// The member of `union bpf_attr` the `*_GET_NEXT_ID` and `*_GET_FD_BY_ID` commands
/// take: an id (start_id, or prog_id / link_id), next_id, open_flags.
#[repr(C)]
struct ById {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// An fd of the object `id` (`cmd`: BPF_PROG_GET_FD_BY_ID, BPF_LINK_GET_FD_BY_ID);
/// ENOENT once it is gone.
fn fd_by_id(cmd: libc::c_long, id: u32) -> io::Result<OwnedFd> {
    let mut attr = ById {
        id,
        next_id: 0,
        open_flags: 0,
    };
    // SAFETY: the attribute is the command's member, whole.
    let fd = unsafe { bpf(cmd, &mut attr) }?;
    // SAFETY: the kernel returned a new fd, ours to close.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The next program id after `start` (BPF_PROG_GET_NEXT_ID), None after the last.
pub fn prog_next_id(start: u32) -> io::Result<Option<u32>> {
    let mut attr = ById {
        id: start,
        next_id: 0,
        open_flags: 0,
    };
    // SAFETY: the attribute is the command's member, whole.
    match unsafe { bpf(BPF_PROG_GET_NEXT_ID, &mut attr) } {
        Ok(_) => Ok(Some(attr.next_id)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// An fd of program `id`; ENOENT once it is unloaded.
pub fn prog_fd(id: u32) -> io::Result<OwnedFd> {
    fd_by_id(BPF_PROG_GET_FD_BY_ID, id)
}

/// struct bpf_prog_info up to its name (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct ProgInfo {
    prog_type: u32,
    id: u32,
    tag: [u8; 8],
    _lens_and_pointers: [u32; 12],
    name: [u8; 16],
}

/// A program's type (enum bpf_prog_type) and name.
pub fn prog_type_and_name(fd: BorrowedFd<'_>) -> io::Result<(u32, String)> {
    let info: ProgInfo = obj_info(fd)?;
    let end = info.name.iter().position(|b| *b == 0).unwrap_or(16);
    Ok((
        info.prog_type,
        String::from_utf8_lossy(&info.name[..end]).into_owned(),
    ))
}
