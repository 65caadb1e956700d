use wagma::engine::{ContributionMode, ReadMode, Trigger};
use wagma::exec::{threaded, virtual_time};
use wagma::topology::GroupingKind;
use wagma::{EngineConfig, Payload, StreamConfig};

#[test]
fn smoke_allreduce_threads() {
    let r = threaded::run(5, EngineConfig::default(), async |c: &mut wagma::Comm| {
        let v = c
            .allreduce(Payload::Data(vec![c.rank() as f32; 1000]))
            .await?;
        Ok(v.as_slice()[0])
    });
    assert_eq!(r.into_all().unwrap(), vec![10.0; 5]);
}

#[test]
fn smoke_stream_virtual() {
    let r = virtual_time::run(
        8,
        EngineConfig::default(),
        virtual_time::VirtualConfig::seeded(1),
        async |c: &mut wagma::Comm| {
            c.open_stream(StreamConfig {
                group_size: 4,
                grouping: GroupingKind::Butterfly,
                trigger: Trigger::Solo,
                mode: ContributionMode::Model,
                read: ReadMode::Latest,
                sync_period: Some(5),
                initial: Payload::Data(vec![0.0; 10]),
                initial_steps: 0,
            })
            .await?;
            let mut fresh = 0;
            for t in 0..20u64 {
                c.compute(std::time::Duration::from_millis(
                    1 + (c.rank() as u64 * 7 + t * 3) % 5,
                ))
                .await;
                let r = c
                    .arrive(t, Payload::Data(vec![c.rank() as f32; 10]), t + 1)
                    .await?;
                fresh += r.fresh as u32;
            }
            Ok(fresh)
        },
    );
    let v = r.into_all().unwrap();
    eprintln!("{v:?}");
}
