//! Finding this process's rank, the world size and the rendezvous from the launcher's
//! environment.
//!
//! Sources, in order of precedence (the first that sets a rank wins; every other source that
//! also sets one must agree, or [`discover`] fails loudly naming both):
//! 1. wagma: `WAGMA_RANK`, `WAGMA_WORLD_SIZE`, `WAGMA_RENDEZVOUS` (set by `wagma launch`);
//! 2. Open MPI (`mpirun`): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`;
//! 3. MPICH and other PMI launchers: `PMI_RANK`, `PMI_SIZE`;
//! 4. SLURM (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, and the first host of
//!    `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`) as the rendezvous host;
//! 5. torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.
//!
//! The rendezvous is `WAGMA_RENDEZVOUS` if set, else `MASTER_ADDR:MASTER_PORT`, else the first
//! SLURM host with `WAGMA_PORT` (default 29500).

use super::tcp::env;
use crate::Rank;
use crate::error::ConfigError;

/// Where the job's coordinates came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    /// This process's rank.
    pub rank: Rank,
    /// Number of ranks.
    pub world: usize,
    /// Rank among the processes of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// `host:port` of rank 0's rendezvous, when it can be derived.
    pub rendezvous: Option<String>,
    /// The source that set the rank.
    pub source: &'static str,
}

struct Source {
    name: &'static str,
    rank: &'static str,
    world: &'static str,
    local: Option<&'static str>,
}

const SOURCES: [Source; 5] = [
    Source {
        name: "wagma",
        rank: env::RANK,
        world: env::WORLD_SIZE,
        local: None,
    },
    Source {
        name: "Open MPI",
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
    },
    Source {
        name: "PMI",
        rank: "PMI_RANK",
        world: "PMI_SIZE",
        local: None,
    },
    Source {
        name: "SLURM",
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local: Some("SLURM_LOCALID"),
    },
    Source {
        name: "torchrun",
        rank: "RANK",
        world: "WORLD_SIZE",
        local: Some("LOCAL_RANK"),
    },
];

/// Default rendezvous port when only a host is known.
pub const DEFAULT_PORT: u16 = 29500;

fn number(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<usize>, ConfigError> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| ConfigError::Invalid {
                what: var,
                detail: format!("{v:?} is not a number"),
            }),
    }
}

/// The first host of a SLURM host list such as `node[01-04,07],gpu3`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map_or(list.len(), |(i, _)| i);
    let mut out = String::new();
    let mut chars = list[..end].chars();
    while let Some(c) = chars.next() {
        if c != '[' {
            out.push(c);
            continue;
        }
        // The first value of a bracket group: `[01-04,07]` gives `01`.
        let mut taking = true;
        for c2 in chars.by_ref() {
            if c2 == ']' {
                break;
            }
            if c2 == ',' || c2 == '-' {
                taking = false;
            } else if taking {
                out.push(c2);
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The most ranks a job of processes may have: every process keeps per-rank state (rank 0
/// an address for each), and the wire carries ranks in 32 bits.
pub const MAX_PROCESS_RANKS: usize = 1 << 20;

/// Checks that `rank` is one of `world` ranks of a job of processes.
pub fn check_rank(rank: Rank, world: usize) -> Result<(), ConfigError> {
    if world == 0 {
        return Err(ConfigError::ZeroRanks);
    }
    if world > MAX_PROCESS_RANKS {
        return Err(ConfigError::Invalid {
            what: "world size",
            detail: format!("{world} ranks (a job of processes has at most {MAX_PROCESS_RANKS})"),
        });
    }
    if rank >= world {
        return Err(ConfigError::RankOutOfRange { rank, ranks: world });
    }
    Ok(())
}

/// [`discover`] on this process's environment.
pub fn discover_env() -> Result<Option<Discovered>, ConfigError> {
    discover(&|k: &str| std::env::var(k).ok())
}

/// Reads the launcher's environment through `get`; `Ok(None)` when no source sets a rank.
pub fn discover(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Discovered>, ConfigError> {
    let mut found: Option<Discovered> = None;
    for s in &SOURCES {
        let (Some(rank), Some(world)) = (number(get, s.rank)?, number(get, s.world)?) else {
            continue;
        };
        check_rank(rank, world)?;
        match &found {
            None => {
                found = Some(Discovered {
                    rank,
                    world,
                    local_rank: match s.local {
                        Some(v) => number(get, v)?,
                        None => None,
                    },
                    rendezvous: None,
                    source: s.name,
                });
            }
            Some(f) if f.rank != rank || f.world != world => {
                return Err(ConfigError::Invalid {
                    what: "launcher environment",
                    detail: format!(
                        "{} says rank {} of {}, but {} says rank {rank} of {world} ({}={rank}, {}={world})",
                        f.source, f.rank, f.world, s.name, s.rank, s.world
                    ),
                });
            }
            Some(_) => {}
        }
    }
    let Some(mut d) = found else {
        return Ok(None);
    };
    let port = match get("WAGMA_PORT") {
        Some(p) => p.trim().parse::<u16>().map_err(|_| ConfigError::Invalid {
            what: "WAGMA_PORT",
            detail: format!("{p:?} is not a port"),
        })?,
        None => DEFAULT_PORT,
    };
    d.rendezvous = get(env::RENDEZVOUS)
        .or_else(|| match (get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(a), Some(p)) => Some(host_port(&a, p.trim())),
            (Some(a), None) => Some(host_port(&a, &port.to_string())),
            _ => None,
        })
        .or_else(|| {
            get("SLURM_STEP_NODELIST")
                .or_else(|| get("SLURM_JOB_NODELIST"))
                .and_then(|l| first_host(&l))
                .map(|h| host_port(&h, &port.to_string()))
        });
    Ok(Some(d))
}

/// `host:port`, with an IPv6 literal in brackets (`[fe80::1]:1234`), so that the port cannot
/// be read as the address's last group. A host with a zone (`fe80::1%eth0`) is left bare:
/// the resolver takes it so, and not in brackets.
fn host_port(host: &str, port: &str) -> String {
    let host = host.trim();
    if host.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn sources_and_precedence() {
        assert_eq!(discover(&env(&[])).unwrap(), None);
        let d = discover(&env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (d.rank, d.world, d.local_rank, d.source),
            (2, 4, Some(0), "Open MPI")
        );
        let d = discover(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(d.rendezvous.as_deref(), Some("10.0.0.1:1234"));
        // srun sets both SLURM and PMI variables; they agree.
        let d = discover(&env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "8"),
            ("SLURM_STEP_NODELIST", "nid[0012-0015]"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (d.source, d.rendezvous.as_deref()),
            ("PMI", Some("nid0012:29500"))
        );
        // wagma's own variables win over the others when they agree.
        let d = discover(&env(&[
            ("WAGMA_RANK", "1"),
            ("WAGMA_WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(d.source, "wagma");
    }

    #[test]
    fn a_world_beyond_what_a_job_of_processes_holds_is_refused() {
        let too_many = (MAX_PROCESS_RANKS + 1).to_string();
        let e = discover(&env(&[
            ("WAGMA_RANK", "1"),
            ("WAGMA_WORLD_SIZE", &too_many),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("world size"), "{e}");
        let most = MAX_PROCESS_RANKS.to_string();
        let d = discover(&env(&[("WAGMA_RANK", "1"), ("WAGMA_WORLD_SIZE", &most)]));
        assert!(d.is_ok_and(|d| d.is_some_and(|d| d.world == MAX_PROCESS_RANKS)));
    }

    #[test]
    fn conflicts_fail_loudly() {
        let e = discover(&env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
        ]))
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("Open MPI") && msg.contains("torchrun") && msg.contains("RANK=2"),
            "{msg}"
        );
        assert!(discover(&env(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")])).is_err());
        assert!(discover(&env(&[("PMI_RANK", "x"), ("PMI_SIZE", "4")])).is_err());
    }

    #[test]
    fn an_ipv6_master_addr_is_bracketed() {
        let rendezvous = |addr: &str, port: Option<&str>| {
            let mut vars = vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", addr)];
            vars.extend(port.map(|p| ("MASTER_PORT", p)));
            discover(&env(&vars)).unwrap().unwrap().rendezvous.unwrap()
        };
        assert_eq!(rendezvous("fe80::1", Some("1234")), "[fe80::1]:1234");
        assert_eq!(rendezvous("::1", None), format!("[::1]:{DEFAULT_PORT}"));
        assert_eq!(rendezvous("[::1]", Some("1234")), "[::1]:1234");
        assert_eq!(rendezvous("10.0.0.1", Some("1234")), "10.0.0.1:1234");
        assert_eq!(rendezvous("node7", Some("1234")), "node7:1234");
        // Each is one address the resolver reads without guessing where the port starts.
        let parsed: std::net::SocketAddr = rendezvous("fe80::1", Some("1234")).parse().unwrap();
        assert_eq!(parsed.port(), 1234);
    }

    #[test]
    fn host_lists() {
        assert_eq!(first_host("node[01-04,07],gpu3").as_deref(), Some("node01"));
        assert_eq!(first_host("a1,a2").as_deref(), Some("a1"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host("rack[3-4]-n[1-2]").as_deref(), Some("rack3-n1"));
        assert_eq!(first_host(""), None);
    }
}
