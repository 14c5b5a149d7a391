//! Reading a whole BPF hash map in a few syscalls.
//!
//! aya 0.14's `HashMap::iter` makes two bpf(2) calls per entry (`BPF_MAP_GET_NEXT_KEY`,
//! then `BPF_MAP_LOOKUP_ELEM`): 200,000 syscalls for 100,000 destinations. The kernel's
//! `BPF_MAP_LOOKUP_BATCH` (Linux 5.6+) copies many entries per call, and aya 0.14 has no
//! API for it, so this module issues it through the raw syscall on the fd aya holds.
//! Kernels without it (EINVAL: unknown command) or maps without batch support
//! (ENOTSUPP) get aya's iterator instead.
//!
//! Sources: include/uapi/linux/bpf.h (`BPF_MAP_LOOKUP_BATCH`, the `batch` member of
//! `union bpf_attr`) and kernel/bpf/hashtab.c (`__htab_map_lookup_and_delete_batch`:
//! walks whole buckets, keys and values packed at `key_size` and `value_size` strides,
//! ENOSPC when one bucket does not fit, ENOENT with the last entries at the end).
use std::{
    borrow::Borrow,
    io,
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicBool, Ordering},
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap, MapData},
};

/// `BPF_MAP_LOOKUP_BATCH` from `enum bpf_cmd`.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// The kernel-internal ENOTSUPP (not EOPNOTSUPP), returned for maps without batch ops.
const ENOTSUPP: i32 = 524;
/// Entries asked for per call (the kernel may return fewer: it stops at a bucket's end).
const CHUNK: usize = 8192;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Cleared the first time the kernel says it has no batch lookup, so later dumps go
/// straight to the iterator.
static BATCH_SUPPORTED: AtomicBool = AtomicBool::new(true);

/// Every entry of a hash map. Entries that a concurrent delete removes mid-dump may be
/// missing, as with aya's iterator.
pub fn entries<T: Borrow<MapData>, K: Pod, V: Pod>(map: &HashMap<T, K, V>) -> Vec<(K, V)> {
    if BATCH_SUPPORTED.load(Ordering::Relaxed) {
        match lookup_batch(map.map()) {
            Ok(all) => return all,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | ENOTSUPP)) => {
                log::debug!("BPF_MAP_LOOKUP_BATCH unavailable ({e}); reading maps entry by entry");
                BATCH_SUPPORTED.store(false, Ordering::Relaxed);
            }
            Err(e) => log::warn!("BPF_MAP_LOOKUP_BATCH failed ({e}); reading entry by entry"),
        }
    }
    map.iter().filter_map(Result::ok).collect()
}

/// The whole map with `BPF_MAP_LOOKUP_BATCH`. `K` and `V` have the map's key and value
/// sizes (aya's `HashMap::try_from` checked them).
fn lookup_batch<K: Pod, V: Pod>(map: &MapData) -> io::Result<Vec<(K, V)>> {
    let fd = map.fd().as_fd().as_raw_fd();
    // Pod types are plain bytes: all zeros is a valid value.
    let zero_key: K = unsafe { std::mem::zeroed() };
    let zero_value: V = unsafe { std::mem::zeroed() };
    // Small maps (TIME_WAITS, EADDRNOTAVAIL) need no CHUNK-sized buffers.
    let max_entries = map.info().map_or(CHUNK as u32, |i| i.max_entries());
    let chunk = CHUNK.min(max_entries.max(1) as usize);
    let mut keys = vec![zero_key; chunk];
    let mut values = vec![zero_value; chunk];
    // A hash map's batch position is a bucket index (u32); 8 bytes leave room. The
    // first call starts at the beginning (no in_batch); each next one where the last
    // stopped.
    let (mut in_position, mut out_position) = (0u64, 0u64);
    let mut out = Vec::new();
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                &raw const in_position as u64
            },
            out_batch: &raw mut out_position as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: keys.len() as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        // SAFETY: the buffers hold `count` keys and values of the map's sizes and outlive
        // the call; the attribute is the kernel's layout and size.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                std::mem::size_of::<BatchAttr>() as u32,
            )
        };
        let err = (ret < 0).then(io::Error::last_os_error);
        match err.as_ref().and_then(io::Error::raw_os_error) {
            // ENOENT: the walk ended; `count` holds the last entries.
            None | Some(libc::ENOENT) => {
                let n = attr.count as usize;
                out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
                if err.is_some() {
                    return Ok(out);
                }
                in_position = out_position;
                first = false;
            }
            // One bucket holds more entries than the buffers: grow them, same position.
            Some(libc::ENOSPC) => {
                keys.resize(keys.len() * 2, zero_key);
                values.resize(values.len() * 2, zero_value);
            }
            _ => return Err(err.expect("ret < 0")),
        }
    }
}
