//! Addresses as the maps hold them: 16 bytes, network order, IPv4 IPv4-mapped
//! (`::ffff:a.b.c.d`).
use core::net::{IpAddr, Ipv6Addr};

/// An address in the maps' form.
pub fn mapped(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// An address in the maps' form back as an address: IPv4 when it is IPv4-mapped.
pub fn unmapped(addr: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(addr);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// `a.b.c.d:port`, or `[v6]:port`, as stats and reports write a destination. IPv4 goes
/// through itoa: `stats` writes one per tracked destination (100,000s), and `format!`
/// costs several times more.
#[cfg(feature = "user")]
pub fn endpoint(addr: IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => {
            let mut s = String::with_capacity("255.255.255.255:65535".len());
            let mut digits = itoa::Buffer::new();
            for (i, octet) in a.octets().into_iter().enumerate() {
                if i > 0 {
                    s.push('.');
                }
                s.push_str(digits.format(octet));
            }
            s.push(':');
            s.push_str(digits.format(port));
            s
        }
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

#[cfg(all(test, feature = "user"))]
mod tests {
    use super::*;

    #[test]
    fn ipv4_is_ipv4_mapped_and_back() {
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let m = mapped(v4);
        assert_eq!(m[..12], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(unmapped(m), v4);
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(unmapped(mapped(v6)), v6);
    }

    #[test]
    fn endpoints_are_written_as_display_writes_them() {
        for (addr, port) in [
            ("0.0.0.0", 0),
            ("127.1.10.255", 9),
            ("10.20.0.7", 8080),
            ("255.255.255.255", 65535),
            ("1.22.103.4", 100),
            ("fd00::1", 443),
            ("::ffff:10.0.0.1", 80),
        ] {
            let ip: IpAddr = addr.parse().unwrap();
            let expected = match ip {
                IpAddr::V4(a) => format!("{a}:{port}"),
                IpAddr::V6(a) => format!("[{a}]:{port}"),
            };
            assert_eq!(endpoint(ip, port), expected);
        }
    }
}
