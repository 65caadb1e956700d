//! The `wagma` command end to end, on tiny settings so that it cannot rot.

use std::process::Command;

fn wagma() -> Command {
    Command::new(env!("CARGO_BIN_EXE_wagma"))
}

#[test]
fn bench_collectives_runs_over_mem_and_tcp() {
    for transport in ["mem", "tcp"] {
        let out = wagma()
            .args(["bench", "collectives", "--transport", transport, "--ranks", "3", "--elements", "1000", "--reps", "2", "--warmup", "1", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 6);
        for r in rows {
            assert!(r["median_s"].as_f64().unwrap() > 0.0);
            assert!(r["vs_memcpy"].as_f64().unwrap() > 0.0);
        }
    }
}

#[test]
fn bad_numbers_are_refused_with_a_message() {
    let out = wagma().args(["bench", "collectives", "--ranks", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ranks"));
    let out = wagma().args(["bench", "collectives", "--ranks", "4", "--group-size", "5"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("group size"));
}
