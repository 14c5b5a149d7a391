//! Field offsets in kernel structs, from the running kernel's BTF
//! (/sys/kernel/btf/vmlinux): Rust eBPF programs have no CO-RE relocations, so the
//! listener program gets them as read-only globals.
use std::{
    fs::File,
    io::Read,
    os::fd::{AsRawFd, FromRawFd},
    sync::OnceLock,
};

use anyhow::{Context, bail};
use btf_rs::{Backend, Btf, Type};
use guard_common::SockOffsets;

const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// What the per-SYN listener program and the state tracepoint read, each field checked
/// for its size. Found once per process (the feature probe and the loader both ask): a
/// distribution kernel's BTF is megabytes of types, not to be read twice.
pub fn sock_offsets() -> anyhow::Result<SockOffsets> {
    static FOUND: OnceLock<Result<SockOffsets, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| find_sock_offsets().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn find_sock_offsets() -> anyhow::Result<SockOffsets> {
    offsets_in(&kernel_btf()?)
}

/// The offsets in `btf`.
fn offsets_in(btf: &Btf) -> anyhow::Result<SockOffsets> {
    // Each root struct is found once: a lookup by name reads every type's name.
    let root = |name: &'static str| struct_named(btf, name).map(|ty| (name, ty));
    let tcp_sock = root("tcp_sock")?;
    let (net, socket, file, inode) = (root("net")?, root("socket")?, root("file")?, root("inode")?);
    let sock = ["inet_conn", "icsk_inet", "sk"];
    let field = |(name, ty): &(&str, Type), path: &[&str], size: usize| -> anyhow::Result<u32> {
        let (offset, found) = offset_of(btf, ty, path)
            .with_context(|| format!("struct {name}: {}", path.join(".")))?;
        if found != size {
            bail!(
                "struct {name}: {} is {found} bytes, not {size}",
                path.join(".")
            );
        }
        Ok(offset)
    };
    let in_sock = |name: &'static str| [&sock[..], &[name]].concat();
    // struct sock starts struct tcp_sock: its offsets are the socket's.
    let common = |name: &'static str, size: usize| {
        field(
            &tcp_sock,
            &[&sock[..], &["__sk_common", name]].concat(),
            size,
        )
    };
    Ok(SockOffsets {
        ack_backlog: field(&tcp_sock, &in_sock("sk_ack_backlog"), 4)?,
        max_ack_backlog: field(&tcp_sock, &in_sock("sk_max_ack_backlog"), 4)?,
        syn_queue: field(&tcp_sock, &["inet_conn", "icsk_accept_queue", "qlen"], 4)?,
        young: field(&tcp_sock, &["inet_conn", "icsk_accept_queue", "young"], 4)?,
        net: common("skc_net", 8)?,
        net_inum: field(&net, &["ns", "inum"], 4)?,
        sk_socket: field(&tcp_sock, &in_sock("sk_socket"), 8)?,
        socket_file: field(&socket, &["file"], 8)?,
        file_inode: field(&file, &["f_inode"], 8)?,
        inode_ino: field(&inode, &["i_ino"], 8)?,
        family: common("skc_family", 2)?,
        num: common("skc_num", 2)?,
        daddr: common("skc_daddr", 4)?,
        rcv_saddr: common("skc_rcv_saddr", 4)?,
        v6_daddr: common("skc_v6_daddr", 16)?,
        v6_rcv_saddr: common("skc_v6_rcv_saddr", 16)?,
    })
}

/// The kernel's BTF, mapped rather than parsed whole (btf-rs's Mmap backend: an index
/// of where each type starts, each read when asked), which takes a fraction of the time
/// and memory of a whole parse for the few structs read here. Where sysfs cannot map the
/// file (it has no mmap on older kernels), a copy in a memfd is mapped.
fn kernel_btf() -> anyhow::Result<Btf> {
    if let Ok(btf) = Btf::from_file_with_backend(VMLINUX, Backend::Mmap) {
        return Ok(btf);
    }
    let mut file = File::open(VMLINUX).with_context(|| format!("opening {VMLINUX}"))?;
    mapped_copy(&mut file)
}

/// The BTF that `from` reads, copied to a memfd and mapped from there.
fn mapped_copy(from: &mut impl Read) -> anyhow::Result<Btf> {
    // SAFETY: a NUL-terminated name; the descriptor returned is checked and owned below.
    let fd = unsafe { libc::memfd_create(c"connguard-btf".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create for kernel BTF");
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let mut copy = unsafe { File::from_raw_fd(fd) };
    std::io::copy(from, &mut copy).context("copying kernel BTF to a memfd")?;
    // The mapping keeps the memfd's pages after `copy` closes it.
    let path = format!("/proc/self/fd/{}", copy.as_raw_fd());
    Btf::from_file_with_backend(&path, Backend::Mmap)
        .with_context(|| format!("parsing {VMLINUX} (a copy in a memfd)"))
}

/// struct `name`.
fn struct_named(btf: &Btf, name: &str) -> anyhow::Result<Type> {
    btf.resolve_types_by_name(name)?
        .into_iter()
        .find(|t| matches!(t, Type::Struct(_)))
        .with_context(|| format!("no struct {name}"))
}

/// The byte offset and size of the member at `path` in struct `root`. A member inside
/// an anonymous struct or union is found by its own name.
fn offset_of(btf: &Btf, root: &Type, path: &[&str]) -> anyhow::Result<(u32, usize)> {
    let mut ty = root.clone();
    let mut offset = 0;
    for name in path {
        let (bits, member_ty) = member(btf, &ty, name)?.with_context(|| format!("no {name}"))?;
        offset += bits / 8;
        ty = member_ty;
    }
    Ok((offset, size_of(btf, &ty)?))
}

/// The bit offset and type of the member `name` of struct or union `ty`.
fn member(btf: &Btf, ty: &Type, name: &str) -> anyhow::Result<Option<(u32, Type)>> {
    let (Type::Struct(s) | Type::Union(s)) = ty else {
        bail!("{name} is looked up in a {}", ty.name());
    };
    for m in &s.members {
        // Only the member asked for and anonymous ones have their type read: each read
        // decodes the type from the mapped file.
        let member_name = btf.resolve_name(m).unwrap_or_default();
        if !member_name.is_empty() && member_name != name {
            continue;
        }
        let member_ty = concrete(btf, btf.resolve_chained_type(m)?)?;
        if member_name == name {
            if m.bitfield_size().is_some_and(|bits| bits != 0) || m.bit_offset() % 8 != 0 {
                bail!("{name} is a bitfield");
            }
            return Ok(Some((m.bit_offset(), member_ty)));
        }
        if matches!(member_ty, Type::Struct(_) | Type::Union(_))
            && let Some((bits, found)) = member(btf, &member_ty, name)?
        {
            return Ok(Some((m.bit_offset() + bits, found)));
        }
    }
    Ok(None)
}

/// `ty` with typedefs and qualifiers removed.
fn concrete(btf: &Btf, mut ty: Type) -> anyhow::Result<Type> {
    while let Type::Typedef(_)
    | Type::Const(_)
    | Type::Volatile(_)
    | Type::Restrict(_)
    | Type::TypeTag(_) = ty
    {
        let next = ty.as_btf_type().context("a qualifier without a type")?;
        ty = btf.resolve_chained_type(next)?;
    }
    Ok(ty)
}

fn size_of(btf: &Btf, ty: &Type) -> anyhow::Result<usize> {
    Ok(match concrete(btf, ty.clone())? {
        Type::Int(i) => i.size(),
        Type::Ptr(_) => 8,
        Type::Struct(s) | Type::Union(s) => s.size(),
        Type::Enum(e) => e.size(),
        other => bail!("no size for a {}", other.name()),
    })
}

#[cfg(test)]
mod tests {
    /// The running kernel's BTF has every field the per-SYN listener program reads, and
    /// they are where struct sock puts them: the two backlog counters side by side, the
    /// network namespace in sock_common, at the start of the socket.
    #[test]
    fn sock_offsets_resolve_on_this_kernel() {
        let o = super::sock_offsets().expect("offsets from /sys/kernel/btf/vmlinux");
        assert_eq!(o.max_ack_backlog, o.ack_backlog + 4, "{o:?}");
        assert!(o.net < 136 && o.syn_queue > o.max_ack_backlog, "{o:?}");
        assert_eq!(o.young, o.syn_queue + 4, "{o:?}");
        // sock_common: the address pair, then the port pair (skc_num after skc_dport).
        assert_eq!((o.rcv_saddr, o.num % 4), (o.daddr + 4, 2), "{o:?}");
        assert!(
            o.v6_daddr > o.family && o.v6_rcv_saddr == o.v6_daddr + 16,
            "{o:?}"
        );
    }

    /// A copy of the kernel's BTF in a memfd (how kernels that cannot map the sysfs
    /// file are read) and the file as the loader finds it give the offsets of a whole
    /// parse (btf-rs's Cache backend).
    #[test]
    fn mapped_and_copied_kernel_btf_give_the_offsets_of_a_whole_parse() {
        let bytes = std::fs::read(super::VMLINUX).expect("reading kernel BTF");
        let whole = btf_rs::Btf::from_bytes(&bytes).expect("parsing kernel BTF");
        let want = super::offsets_in(&whole).expect("offsets from a whole parse");
        let mut file = std::fs::File::open(super::VMLINUX).expect("opening kernel BTF");
        let copy = super::mapped_copy(&mut file).expect("kernel BTF in a memfd");
        assert_eq!(
            super::offsets_in(&copy).expect("offsets from the copy"),
            want
        );
        assert_eq!(super::sock_offsets().expect("offsets"), want);
    }
}
