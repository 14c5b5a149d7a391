//! Addresses in the maps' form (guard_common::addr), built from the words the contexts
//! give: as four words, because building the bytes one by one on a zeroed array costs a
//! memset loop (see `opaque_zero`).

/// The bytes of an address (network order) given as four words holding them in memory
/// order, as the connect and sock_ops contexts give them.
#[inline(always)]
pub fn words_addr(words: [u32; 4]) -> [u8; 16] {
    // Same size, and every bit pattern is a valid [u8; 16].
    unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) }
}

/// `::ffff:a.b.c.d` for an IPv4 address given as the word holding it in memory order.
#[inline(always)]
pub fn ipv4_mapped(ip4: u32) -> [u8; 16] {
    let z = opaque_zero();
    words_addr([z, z, u32::from_ne_bytes([0, 0, 0xff, 0xff]), ip4])
}

/// 0, from read-only data: a zero the compiler cannot see. Zeros it sees are merged into
/// a call to memset, which on BPF is a subprogram storing one byte per iteration (about
/// five instructions a byte).
#[inline(always)]
pub fn opaque_zero() -> u32 {
    static ZERO: u32 = 0;
    unsafe { core::ptr::read_volatile(&ZERO) }
}
