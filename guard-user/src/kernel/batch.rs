//! Reading a whole BPF hash map, or the first entries of an array, in a few syscalls.
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
    collections::HashSet,
    hash::Hash,
    io,
    ops::Range,
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicBool, Ordering},
};

use aya::{
    Pod,
    maps::{Array, HashMap, IterableMap, MapData},
};

use super::syscall::{BPF_MAP_LOOKUP_BATCH, bpf};

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

/// `BPF_MAP_LOOKUP_BATCH` with `attr`; the error, if it failed.
///
/// # Safety
/// `attr`'s buffers hold `count` keys and values of the map's key and value sizes, and
/// `out_batch` (and `in_batch`, when set) a position of the map's kind.
unsafe fn lookup_batch_call(attr: &mut BatchAttr) -> Option<io::Error> {
    // SAFETY: the attribute is the kernel's layout; the buffers are the caller's.
    unsafe { bpf(BPF_MAP_LOOKUP_BATCH, attr) }.err()
}

/// Whether the kernel knows BPF_MAP_LOOKUP_BATCH: asked with map_fd -1, it fails with
/// EBADF; an unknown command fails with EINVAL.
pub fn lookup_batch_known() -> anyhow::Result<bool> {
    let mut attr = BatchAttr {
        map_fd: u32::MAX,
        ..Default::default()
    };
    // SAFETY: no buffer is read or written: the fd -1 fails the command first.
    match unsafe { lookup_batch_call(&mut attr) } {
        Some(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Some(e) if e.raw_os_error() == Some(libc::EBADF) => Ok(true),
        Some(e) => anyhow::bail!("BPF_MAP_LOOKUP_BATCH with map_fd -1: {e}"),
        None => anyhow::bail!("BPF_MAP_LOOKUP_BATCH with map_fd -1 succeeded"),
    }
}

/// Set from the start's feature probe (`use_batch_lookups`), and cleared the first
/// time the kernel says it has no batch lookup, so later dumps go straight to the
/// iterator.
static BATCH_SUPPORTED: AtomicBool = AtomicBool::new(true);

/// Whether to try batch lookups at all (false when the probe found none).
pub fn use_batch_lookups(yes: bool) {
    BATCH_SUPPORTED.store(yes, Ordering::Relaxed);
}

/// `read()`'s entries, unless batch lookups are unsupported (then never tried again)
/// or failed: then None, and the caller reads entry by entry.
fn batched<T>(read: impl FnOnce() -> io::Result<T>) -> Option<T> {
    if !BATCH_SUPPORTED.load(Ordering::Relaxed) {
        return None;
    }
    match read() {
        Ok(all) => Some(all),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | ENOTSUPP)) => {
            log::debug!("BPF_MAP_LOOKUP_BATCH unavailable ({e}); reading maps entry by entry");
            BATCH_SUPPORTED.store(false, Ordering::Relaxed);
            None
        }
        Err(e) => {
            log::warn!("BPF_MAP_LOOKUP_BATCH failed ({e}); reading entry by entry");
            None
        }
    }
}

/// Every entry of a hash map. Entries that a concurrent delete removes mid-dump may be
/// missing, as with aya's iterator.
pub fn entries<T: Borrow<MapData>, K: Pod, V: Pod>(map: &HashMap<T, K, V>) -> Vec<(K, V)> {
    let mut out = Vec::new();
    let read = |keys: &[K], values: &[V], _| {
        out.extend(keys.iter().copied().zip(values.iter().copied()));
    };
    if batched(|| lookup_batch(map.map(), 0..u32::MAX, read)).is_some() {
        return out;
    }
    // A batch that failed midway gave some entries: the read starts over.
    map.iter().filter_map(Result::ok).collect()
}

/// Every entry of a hash map, as `entries` reads them, in the chunks the kernel gave
/// them (CHUNK entries at most each): a caller that turns a large map into something
/// else can free each chunk as it goes, rather than hold the whole map beside what it
/// makes.
///
/// The kernel's walk of a large map takes most of the time (a bucket lock and a copy
/// per entry), so two threads walk half of the buckets each. The first's last call may
/// run past the half: what it read there, the second read too, and it is dropped.
pub fn chunks<T, K, V>(map: &HashMap<T, K, V>) -> Vec<Vec<(K, V)>>
where
    T: Borrow<MapData>,
    K: Pod + Eq + Hash + Send,
    V: Pod + Send,
{
    let data = map.map();
    // hashtab.c: a hash map has max_entries rounded up to a power of two buckets.
    let half = data
        .info()
        .map_or(0, |i| i.max_entries().next_power_of_two() / 2);
    let walk = |buckets: Range<u32>| {
        let mut out = Vec::new();
        lookup_batch(data, buckets, |keys: &[K], values: &[V], read| {
            let chunk: Vec<(K, V)> = keys.iter().copied().zip(values.iter().copied()).collect();
            out.push((chunk, read));
        })
        .map(|()| out)
    };
    let halves = batched(|| {
        std::thread::scope(|s| {
            let second = s.spawn(|| walk(half..u32::MAX));
            let first = walk(0..half);
            let second = second
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            Ok((first?, second?))
        })
    });
    let Some((mut first, second)) = halves else {
        return vec![map.iter().filter_map(Result::ok).collect()];
    };
    if let Some((last, read)) = first.last_mut()
        && read.end > half
    {
        let twice: HashSet<K> = second
            .iter()
            .take_while(|(_, b)| b.start < read.end)
            .flat_map(|(chunk, _)| chunk.iter().map(|(k, _)| *k))
            .collect();
        last.retain(|(k, _)| !twice.contains(k));
    }
    first
        .into_iter()
        .chain(second)
        .map(|(chunk, _)| chunk)
        .collect()
}

/// Entries `0..n` of an array map (`n` at most its size), in index order.
pub fn array_prefix<T: Borrow<MapData>, V: Pod>(map: &Array<T, V>, n: u32) -> Vec<V> {
    let n = n.min(map.len());
    if n == 0 {
        return Vec::new();
    }
    if let Some(all) = batched(|| array_batch(map.map(), n)) {
        return all;
    }
    (0..n)
        .map(|i| {
            map.get(&i, 0)
                .unwrap_or_else(|_| unsafe { std::mem::zeroed() })
        })
        .collect()
}

/// Entries `0..n` of an array with one `BPF_MAP_LOOKUP_BATCH` (kernel/bpf/syscall.c
/// `generic_map_lookup_batch`: from the first index, `count` entries in index order).
fn array_batch<V: Pod>(map: &MapData, n: u32) -> io::Result<Vec<V>> {
    let fd = map.fd().as_fd().as_raw_fd();
    // Pod types are plain bytes: all zeros is a valid value.
    let zero_value: V = unsafe { std::mem::zeroed() };
    let mut keys = vec![0u32; n as usize];
    let mut values = vec![zero_value; n as usize];
    let mut last = 0u32;
    let mut attr = BatchAttr {
        out_batch: &mut last as *mut u32 as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: n,
        map_fd: fd as u32,
        ..Default::default()
    };
    // SAFETY: the buffers hold `count` keys (u32) and values of the map's sizes and
    // outlive the call.
    if let Some(err) = unsafe { lookup_batch_call(&mut attr) }
        // ENOENT: the array ended before `count` (not with n <= its size).
        && err.raw_os_error() != Some(libc::ENOENT)
    {
        return Err(err);
    }
    let got = attr.count as usize;
    if got != n as usize || keys.iter().enumerate().any(|(i, k)| *k as usize != i) {
        return Err(io::Error::other(format!(
            "array batch returned {got} of {n} entries, or out of order"
        )));
    }
    Ok(values)
}

/// Buckets `buckets.start..` of a hash map with `BPF_MAP_LOOKUP_BATCH`, given to `read` a
/// call's entries at a time (none given twice) with the buckets the call read; the walk
/// ends at the map's end or after the call that reaches `buckets.end`. `K` and `V` have
/// the map's key and value sizes (aya's `HashMap::try_from` checked them). An error
/// after some calls: `read` has had their entries.
fn lookup_batch<K: Pod, V: Pod>(
    map: &MapData,
    buckets: Range<u32>,
    mut read: impl FnMut(&[K], &[V], Range<u32>),
) -> io::Result<()> {
    let fd = map.fd().as_fd().as_raw_fd();
    // Pod types are plain bytes: all zeros is a valid value.
    let zero_key: K = unsafe { std::mem::zeroed() };
    let zero_value: V = unsafe { std::mem::zeroed() };
    // Small maps (TIME_WAITS, EADDRNOTAVAIL) need no CHUNK-sized buffers.
    let max_entries = map.info().map_or(CHUNK as u32, |i| i.max_entries());
    let chunk = CHUNK.min(max_entries.max(1) as usize);
    let mut keys = vec![zero_key; chunk];
    let mut values = vec![zero_value; chunk];
    // A hash map's batch position is a bucket index (u32, hashtab.c): each call starts
    // where the last stopped.
    let mut position = buckets.start;
    loop {
        // A start past the last bucket fails with ENOENT before the kernel writes the
        // count or the position: the position left at NOT_WRITTEN tells it.
        let mut next = NOT_WRITTEN;
        let mut attr = BatchAttr {
            in_batch: &raw const position as u64,
            out_batch: &raw mut next as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: keys.len() as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        // SAFETY: the buffers hold `count` keys and values of the map's sizes and outlive
        // the call.
        let err = unsafe { lookup_batch_call(&mut attr) };
        match err.as_ref().and_then(io::Error::raw_os_error) {
            // ENOENT: the walk ended; `count` holds the last entries.
            None | Some(libc::ENOENT) => {
                let n = if next == NOT_WRITTEN {
                    0
                } else {
                    attr.count as usize
                };
                if n > 0 {
                    read(&keys[..n], &values[..n], position..next);
                }
                if err.is_some() || next >= buckets.end {
                    return Ok(());
                }
                position = next;
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

/// No bucket index: hashtab.c has at most 2^31 buckets.
const NOT_WRITTEN: u32 = u32::MAX;
