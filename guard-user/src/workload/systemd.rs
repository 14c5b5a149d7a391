//! Where systemd and the runtimes' systemd cgroup drivers put cgroups, read from names
//! alone (no D-Bus): systemd.slice(5) nests slices by their dashes (`a-b.slice` lives at
//! `a.slice/a-b.slice`, `-.slice` is the root); a service or scope lives in its slice's
//! directory, in any slice.
use std::path::Path;

use globset::GlobMatcher;

/// The unit types that own a cgroup, as name suffixes.
const CGROUP_UNITS: &[&str] = &[".service", ".scope", ".slice", ".socket", ".mount", ".swap"];

/// The path of slice `name` below the cgroup2 mount ("" for `-.slice`), or None when
/// `name` is no valid slice name (systemd's `slice_name_is_valid`: no leading, trailing or
/// doubled dash).
pub fn slice_path(name: &str) -> Option<String> {
    let stem = name.strip_suffix(".slice")?;
    if stem == "-" {
        return Some(String::new());
    }
    if stem.is_empty() || stem.starts_with('-') || stem.ends_with('-') || stem.contains("--") {
        return None;
    }
    let mut parts = Vec::new();
    for (i, _) in stem.match_indices('-') {
        parts.push(format!("{}.slice", &stem[..i]));
    }
    parts.push(name.to_string());
    Some(parts.join("/"))
}

/// The directory below the cgroup2 mount of an OCI `linux.cgroupsPath` or a CRI
/// `cgroup_parent`: with the systemd driver, a slice (`kubepods-pod1.slice`) or
/// `SLICE:PREFIX:NAME` (the scope `PREFIX-NAME.scope` in SLICE, or the slice NAME when it
/// is one); with the cgroupfs driver, a path (`/kubepods/besteffort/pod1`). None for a
/// malformed systemd form or an empty path.
pub fn cgroup_dir(path: &str) -> Option<String> {
    let systemd = |slice: &str| {
        if slice.is_empty() {
            // runc's systemd driver: no slice means system.slice.
            Some("system.slice".to_string())
        } else {
            slice_path(slice)
        }
    };
    let dir = match path.split(':').collect::<Vec<_>>()[..] {
        [slice, prefix, name] => {
            let parent = systemd(slice)?;
            let unit = if name.ends_with(".slice") {
                return slice_path(name);
            } else if prefix.is_empty() {
                format!("{name}.scope")
            } else {
                format!("{prefix}-{name}.scope")
            };
            if parent.is_empty() {
                unit
            } else {
                format!("{parent}/{unit}")
            }
        }
        [one] if one.ends_with(".slice") && !one.contains('/') => systemd(one)?,
        [one] => one.trim_matches('/').to_string(),
        _ => return None,
    };
    (!dir.is_empty()).then_some(dir)
}

/// Whether `name` (a glob allowed) ends in the suffix of a unit type that owns a cgroup.
pub fn is_cgroup_unit(name: &str) -> bool {
    CGROUP_UNITS
        .iter()
        .any(|s| name.len() > s.len() && name.ends_with(s))
}

/// Whether systemd puts units in the directory named `name`: a slice, or a user
/// manager's `user@UID.service`.
fn holds_units(name: &str) -> bool {
    name.ends_with(".slice") || (name.starts_with("user@") && name.ends_with(".service"))
}

/// Whether the cgroup at `rel` (below the mount, "" for the root) lies where systemd
/// puts units: each directory above it holds units.
pub fn is_unit_place(rel: &str) -> bool {
    match rel.rsplit_once('/') {
        None => !rel.is_empty(),
        Some((parent, _)) => holds_units_below(parent),
    }
}

/// Whether a unit may lie below the cgroup at `rel`: the root, or a directory that
/// holds units, in one that does.
pub fn holds_units_below(rel: &str) -> bool {
    rel.is_empty() || rel.split('/').all(holds_units)
}

/// The cgroups below `mount` of the units whose names `unit` matches: the directories so
/// named in the root's slices, their slices, and so on (and in user managers'
/// `user@UID.service`), as systemd lays them out.
pub fn find_units(mount: &Path, unit: &GlobMatcher) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(mount.join(&rel)) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let child = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if unit.is_match(&name) {
                out.push(child.clone());
            }
            if holds_units(&name) {
                stack.push(child);
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_nest_by_their_dashes() {
        assert_eq!(slice_path("-.slice").as_deref(), Some(""));
        assert_eq!(slice_path("system.slice").as_deref(), Some("system.slice"));
        assert_eq!(
            slice_path("a-b.slice").as_deref(),
            Some("a.slice/a-b.slice")
        );
        assert_eq!(
            slice_path("kubepods-besteffort-pod0f1e_22.slice").as_deref(),
            Some("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e_22.slice")
        );
        for bad in ["a.service", ".slice", "-a.slice", "a-.slice", "a--b.slice"] {
            assert_eq!(slice_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn both_cgroup_drivers_give_a_directory() {
        let cases = [
            // kubelet's cgroup_parent with the systemd driver.
            (
                "kubepods-burstable-pod7a_1.slice",
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod7a_1.slice",
            ),
            // containerd's cgroupsPath for a container with the systemd driver.
            (
                "kubepods-pod7a_1.slice:cri-containerd:0123abc",
                "kubepods.slice/kubepods-pod7a_1.slice/cri-containerd-0123abc.scope",
            ),
            (":docker:42", "system.slice/docker-42.scope"),
            ("-.slice::x", "x.scope"),
            ("a.slice:p:b-c.slice", "b.slice/b-c.slice"),
            // The cgroupfs driver: a path below the hierarchy's root.
            (
                "/kubepods/besteffort/pod7a-1",
                "kubepods/besteffort/pod7a-1",
            ),
            (
                "/kubepods/besteffort/pod7a-1/0123abc",
                "kubepods/besteffort/pod7a-1/0123abc",
            ),
            ("default/ctr", "default/ctr"),
        ];
        for (path, want) in cases {
            assert_eq!(cgroup_dir(path).as_deref(), Some(want), "{path}");
        }
        for bad in ["", "/", "a--b.slice:p:x", "a:b:c:d"] {
            assert_eq!(cgroup_dir(bad), None, "{bad}");
        }
    }

    #[test]
    fn unit_names_must_name_a_unit_with_a_cgroup() {
        assert!(is_cgroup_unit("orders.service"));
        assert!(is_cgroup_unit("orders-*.service"));
        assert!(is_cgroup_unit("a-b.slice"));
        assert!(is_cgroup_unit("session-3.scope"));
        assert!(!is_cgroup_unit("orders.timer"));
        assert!(!is_cgroup_unit(".service"));
        assert!(!is_cgroup_unit("orders"));
    }

    #[test]
    fn units_are_found_where_systemd_puts_them() {
        let root = std::env::temp_dir().join(format!("connguard-units-{}", std::process::id()));
        let dirs = [
            "system.slice/orders.service",
            "system.slice/cron.service",
            "shop.slice/shop-web.slice/orders.service",
            "user.slice/user-1000.slice/user@1000.service/app.slice/orders.service",
            // Not a slice: what lies below is a service's own cgroups, not units.
            "system.slice/cron.service/orders.service",
            "orders.service",
        ];
        for d in dirs {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let glob = |g: &str| globset::Glob::new(g).unwrap().compile_matcher();
        let found = find_units(&root, &glob("orders.service"));
        let slice = find_units(&root, &glob("shop-web.slice"));
        let any = find_units(&root, &glob("*.service"));
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            found,
            [
                "orders.service",
                "shop.slice/shop-web.slice/orders.service",
                "system.slice/orders.service",
                "user.slice/user-1000.slice/user@1000.service/app.slice/orders.service",
            ]
        );
        assert_eq!(slice, ["shop.slice/shop-web.slice"]);
        assert_eq!(any.len(), 6, "{any:?}");
        // Where find_units looks, and only there.
        for path in found.iter().chain(&slice).chain(&any) {
            assert!(is_unit_place(path), "{path}");
        }
        assert!(!is_unit_place("system.slice/cron.service/orders.service"));
        assert!(!is_unit_place(""));
        assert!(holds_units_below(""));
        assert!(holds_units_below(
            "user.slice/user-1000.slice/user@1000.service"
        ));
        assert!(!holds_units_below("system.slice/cron.service"));
    }
}
