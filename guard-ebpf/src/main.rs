//! connguard's kernel side: one module per hook, the maps and the accounting they share.
//!
//! A socket's admission is taken in the cgroup connect4/connect6 hooks (`connect`, which
//! `charge`s it) and released exactly once when the socket reaches TCP_CLOSE
//! (`release`), whichever path gets there first: the sock_ops state callback, or the
//! socket's release while still closed. Every internal problem lets the connection
//! through and is counted (fail-open).
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod accounting;
mod adjust;
mod breaker;
mod callers;
mod charge;
mod clock;
mod connect;
mod drill;
mod events;
mod listener;
mod maps;
mod net;
mod release;
mod scope;
mod seed;
mod set_state;
mod shedding;
mod sock_create;
mod sock_fields;

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
