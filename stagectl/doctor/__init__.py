"""`stagectl doctor`: a preflight of a train-ab config that checks, in seconds to a minute, what would
otherwise fail late. One small function per check, each returning `Check`s (`report`); `run` orders them
(cheap first) and shares what they load (the config, the data set, the model). docs/doctor.md."""
