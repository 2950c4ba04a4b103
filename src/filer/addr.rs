//! Filer address lists as SeaweedFS writes them: `host:port[,host:port...]`, where a port may be
//! written `httpPort.grpcPort`; without an explicit gRPC port it is the HTTP port + 10000.

use std::fmt;

/// Offset of the default gRPC port from the HTTP port (SeaweedFS convention).
pub const GRPC_PORT_OFFSET: u32 = 10000;

/// One filer: where its HTTP API and its gRPC service listen.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FilerAddress {
    /// Host name or IP; IPv6 literals are kept without brackets.
    pub host: String,
    pub http_port: u16,
    pub grpc_port: u16,
}

impl FilerAddress {
    /// Parses one `host:port` or `host:port.grpcPort` (IPv6 as `[::1]:8888`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err("empty filer address".into());
        }
        let (host, ports) = if let Some(rest) = s.strip_prefix('[') {
            let (h, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("invalid filer address {s:?}: missing ']'"))?;
            let ports = after
                .strip_prefix(':')
                .ok_or_else(|| format!("invalid filer address {s:?}: expected [host]:port"))?;
            (h, ports)
        } else {
            s.rsplit_once(':')
                .ok_or_else(|| format!("invalid filer address {s:?}: expected host:port"))?
        };
        if host.is_empty() || host.contains(['/', ' ']) {
            return Err(format!("invalid filer address {s:?}: bad host"));
        }
        let parse_port = |p: &str| -> Result<u16, String> {
            match p.parse::<u16>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("invalid filer address {s:?}: bad port {p:?}")),
            }
        };
        let (http_port, grpc_port) = match ports.split_once('.') {
            Some((h, g)) => (parse_port(h)?, parse_port(g)?),
            None => {
                let h = parse_port(ports)?;
                let g = u32::from(h) + GRPC_PORT_OFFSET;
                let g = u16::try_from(g).map_err(|_| {
                    format!("invalid filer address {s:?}: port {h} + 10000 exceeds 65535")
                })?;
                (h, g)
            }
        };
        Ok(FilerAddress {
            host: host.to_string(),
            http_port,
            grpc_port,
        })
    }

    /// Parses a comma-separated list; empty items are skipped, at least one address is required.
    pub fn parse_list(s: &str) -> Result<Vec<Self>, String> {
        let out: Vec<Self> = s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(Self::parse)
            .collect::<Result<_, _>>()?;
        if out.is_empty() {
            return Err("no filer address given".into());
        }
        Ok(out)
    }

    /// Parses several strings, each of which may itself be a comma-separated list.
    pub fn parse_all<S: AsRef<str>>(items: &[S]) -> Result<Vec<Self>, String> {
        let joined = items
            .iter()
            .map(|s| s.as_ref())
            .collect::<Vec<_>>()
            .join(",");
        Self::parse_list(&joined)
    }

    fn host_for_url(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }

    /// `host:httpPort`
    pub fn http(&self) -> String {
        format!("{}:{}", self.host_for_url(), self.http_port)
    }

    /// `host:grpcPort`
    pub fn grpc(&self) -> String {
        format!("{}:{}", self.host_for_url(), self.grpc_port)
    }
}

impl fmt::Display for FilerAddress {
    /// The SeaweedFS spelling: `host:port`, or `host:port.grpcPort` when the gRPC port is not the default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if u32::from(self.grpc_port) == u32::from(self.http_port) + GRPC_PORT_OFFSET {
            write!(f, "{}", self.http())
        } else {
            write!(f, "{}.{}", self.http(), self.grpc_port)
        }
    }
}

impl std::str::FromStr for FilerAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_grpc_port_is_http_plus_10000() {
        let a = FilerAddress::parse("filer.ns.svc:8888").unwrap();
        assert_eq!(a.host, "filer.ns.svc");
        assert_eq!((a.http_port, a.grpc_port), (8888, 18888));
        assert_eq!(a.http(), "filer.ns.svc:8888");
        assert_eq!(a.grpc(), "filer.ns.svc:18888");
        assert_eq!(a.to_string(), "filer.ns.svc:8888");
    }

    #[test]
    fn explicit_grpc_port() {
        let a = FilerAddress::parse("10.0.0.1:8888.19999").unwrap();
        assert_eq!((a.http_port, a.grpc_port), (8888, 19999));
        assert_eq!(a.grpc(), "10.0.0.1:19999");
        assert_eq!(a.to_string(), "10.0.0.1:8888.19999");
    }

    #[test]
    fn ipv6() {
        let a = FilerAddress::parse("[::1]:8888").unwrap();
        assert_eq!(a.host, "::1");
        assert_eq!(a.http(), "[::1]:8888");
        assert_eq!(a.grpc(), "[::1]:18888");
    }

    #[test]
    fn lists() {
        let v = FilerAddress::parse_list(" a:1, b:2.3 ,,").unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].grpc_port, 10001);
        assert_eq!(v[1].grpc_port, 3);
        let v = FilerAddress::parse_all(&["a:1,b:2", "c:3"]).unwrap();
        assert_eq!(
            v.iter().map(|a| a.host.as_str()).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            "",
            "host",
            "host:",
            ":8888",
            "h:0",
            "h:abc",
            "h:8888.",
            "h:70000",
            "h:60000",
            "[::1",
            "[::1]8888",
            "a b:1",
        ] {
            assert!(FilerAddress::parse(bad).is_err(), "{bad:?} should fail");
        }
        assert!(FilerAddress::parse_list(" , ").is_err());
        assert!(FilerAddress::parse_list("a:1,bad").is_err());
    }
}
